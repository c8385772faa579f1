"""Profile choice, a pure function: per pool, the highest precision whose memory needs fit the device.

Order of preference: the activation dtype (bf16 where the device supports it, fp16 on pre-Ampere GPUs, fp32
on CPUs without bf16) unquantized, then weight-only int8, then int4; within one precision, the fewest GPUs
(tensor parallelism) among the counts the runtime can split the model's attention heads over.
A model that fits no node at any precision may span nodes (spec.placement.maxNodesPerReplica, or pinned by
spec.parallelism): pipeline stages of consecutive layers, one node each, tensor parallel inside each node
(vLLM's layout), run as a LeaderWorkerSet group (manifests_lws.py). Fewer nodes come before higher precision:
one node at int4 beats two at bf16, since a group pays the pipeline's link and restarts as a whole. The memory
arithmetic of a group is per stage: each pod holds its stage's layers, their KV and one vocabulary matrix.
Pins and forbidden quantizations from the spec narrow the candidates. A pool where nothing fits gets no
profile but a reason, so that status can say why it is unused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kubernetes.utils import parse_quantity

from hpi_contracts.serve_flags import SERVE_FLAGS

from .nodes import Pool
from .sizing import (
    ModelShape,
    encoder_cache_bytes,
    gib,
    kv_bytes_per_token,
    kv_cache_bytes,
    linear_dtype,
    overhead_bytes,
    splits_heads,
    stage_partition,
    stage_weight_bytes,
    why_heads_do_not_split,
)
from .spec import MAX_PIPELINE_STAGES, InferenceSpec

QUANTIZATION_ORDER = ("none", "int8", "int4")
GPU_COUNTS = (1, 2, 4, 8)
GPU_HOST_MEMORY_BYTES = 8 * 2**30  # host RAM for a GPU replica: tokenizer, loader staging, HTTP server
# kvOffloadMemory "auto": the share of a replica's slice of node memory (after GPU_HOST_MEMORY_BYTES) the host
# KV tier takes, leaving the rest to the node; at most this many times the replica's GPU KV cache (a bigger
# host tier mostly holds prefixes no conversation returns to); nothing when it would be under the minimum.
KV_OFFLOAD_NODE_FRACTION = 0.5
KV_OFFLOAD_MAX_KV_MULTIPLE = 4
KV_OFFLOAD_MIN_BYTES = 2**30


@dataclass(frozen=True)
class Profile:
    """How replicas run on one pool, with the memory arithmetic that justified it."""

    device: str  # cuda | cpu
    dtype: str  # bf16 | fp16 | fp32
    quantization: str  # none | int8 | int4
    num_gpus: int  # per pod (tensor parallel ranks); 0 on CPU
    # The byte figures are per pod: the whole replica on one node, the fullest pipeline stage of a group.
    weight_bytes: int
    kv_cache_bytes: int  # over all the pod's GPUs; the runtime gets kv_cache_bytes_per_gpu
    overhead_bytes: int
    memory_budget_bytes: int  # the part of the device memory the runtime may fill
    prequantized: bool = False  # the checkpoint's own int8/int4: the runtime loads it as is (no --quantization)
    kv_offload_bytes: int = 0  # host memory for the runtime's second KV tier, over the whole pod
    num_nodes: int = 1  # pipeline stages, one pod (node) each: more than one is a LeaderWorkerSet group
    layer_partition: tuple[int, ...] = ()  # decoder layers per stage (the runtime's $VLLM_PP_LAYER_PARTITION)
    kv_cache_dtype: str = "auto"  # the runtime's --kv-cache-dtype (pool_kv_cache_dtype), counted in the arithmetic

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    @property
    def kv_offload_bytes_per_gpu(self) -> int:
        """What `hpi serve --kv-offload-bytes` means: per tensor-parallel rank."""
        return self.kv_offload_bytes // max(self.num_gpus, 1)

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.overhead_bytes

    @property
    def kv_cache_bytes_per_gpu(self) -> int:
        """The KV budget of one tensor-parallel rank (what `hpi serve --kv-cache-memory` means). sizing counts
        the fullest rank's share for every rank, so each rank affords the replica's full token count."""
        return self.kv_cache_bytes // max(self.num_gpus, 1)

    def label(self) -> str:
        quant = "" if self.quantization == "none" else f"/{self.quantization}"
        gpus = f" x{self.num_gpus}" if self.num_gpus > 1 else ""
        nodes = f" x{self.num_nodes} nodes" if self.multi_node else ""
        return f"{self.device}:{self.dtype}{quant}{gpus}{nodes}"


@dataclass(frozen=True)
class PoolChoice:
    """The outcome for one pool: a profile, or none, and a one-line reason a user can read."""

    pool: Pool
    profile: Profile | None
    reason: str
    capacity: int = 0  # replicas (groups, for a profile that spans nodes) the pool's nodes can hold


def pool_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The runtime's --kv-cache-dtype on a pool computing in `dtype`: spec.engine.kvCacheDtype, except that
    bfloat16 on an fp16 pool (GPUs without bf16, such as the T4) keeps the model's fp16 cache: the same two bytes,
    and no bf16 load on a GPU that lacks it."""
    return "auto" if kv_cache_dtype == "bfloat16" and dtype == "fp16" else kv_cache_dtype


def _dtype_for(pool: Pool, pinned: str) -> tuple[str | None, str]:
    if pool.device == "cuda":
        native = "bf16" if pool.gpu_bf16 else "fp16"
        if pinned == "bf16" and not pool.gpu_bf16:
            return None, f"dtype pinned to bf16, which {pool.gpu_product} does not support"
    else:
        # As the runtime's dtype=auto: bf16 with AMX (oneDNN's GEMMs) or AVX512-BF16 (the runtime's packed bf16
        # linears, built by the image's compiler: faster than fp32 there, bench/results/hot_path.md); else fp32.
        native = "bf16" if pool.cpu_bf16 else "fp32"
        if pinned == "bf16" and not pool.cpu_bf16:
            return None, "dtype pinned to bf16, but these CPUs lack AVX512-BF16/AMX-BF16"
        if pinned == "fp16":
            return None, "dtype pinned to fp16, which is not offered on CPU"
    return (native if pinned == "auto" else pinned), ""


def _device_memory_bytes(pool: Pool, spec: InferenceSpec, num_gpus: int) -> int:
    if pool.device == "cuda":
        return pool.gpu_memory_mib * 2**20 * num_gpus
    limit = (spec.resources.get("limits") or {}).get("memory")
    node_memory = pool.min_memory_bytes
    return min(node_memory, int(parse_quantity(limit))) if limit else node_memory


def kv_offload_bytes(pool: Pool, spec: InferenceSpec, num_gpus: int, kv_cache_bytes: int) -> int:
    """The host KV tier of one replica: the spec's kvOffloadMemory, or for "auto" a share of the node memory
    the replica's slice leaves (GPU pools only)."""
    if spec.engine.kv_offload_bytes is not None:
        return spec.engine.kv_offload_bytes
    if pool.device != "cuda" or num_gpus < 1:
        return 0
    replicas_per_node = max(min(pool.gpus_per_node, default=0) // num_gpus, 1)
    spare = pool.min_memory_bytes // replicas_per_node - GPU_HOST_MEMORY_BYTES
    offload = min(int(spare * KV_OFFLOAD_NODE_FRACTION), KV_OFFLOAD_MAX_KV_MULTIPLE * kv_cache_bytes)
    return offload if offload >= KV_OFFLOAD_MIN_BYTES else 0


def _capacity(pool: Pool, profile: Profile) -> int:
    """Replicas the pool holds: pods that fit its nodes, `num_nodes` pods per replica."""
    if pool.device == "cuda":
        pods = sum(gpus // profile.num_gpus for gpus in pool.gpus_per_node)
    else:
        pods = sum(memory // profile.needed_bytes for memory in pool.memory_bytes_per_node)
    return pods // profile.num_nodes


@dataclass(frozen=True)
class _Attempt:
    """The arithmetic of one candidate: a quantization on some number of GPUs per replica."""

    quantization: str
    num_gpus: int
    num_nodes: int
    weight_bytes: int
    min_kv_bytes: int
    max_kv_bytes: int
    overhead_bytes: int
    budget_bytes: int

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.min_kv_bytes + self.overhead_bytes

    @property
    def shortfall_bytes(self) -> int:
        return self.needed_bytes - self.budget_bytes


def _encoder_cache_rows(spec: InferenceSpec) -> int:
    """The runtime's default --encoder-cache-size: its --max-num-batched-tokens."""
    return spec.engine.max_num_batched_tokens or SERVE_FLAGS["--max-num-batched-tokens"].default


def _attempt(
    pool: Pool, spec: InferenceSpec, shape: ModelShape, dtype: str, quantization: str, num_gpus: int,
    num_nodes: int = 1,
) -> _Attempt:
    """The arithmetic of one pod: the whole replica, or the fullest of `num_nodes` pipeline stages."""
    engine = spec.engine
    prequantized = spec.model.checkpoint_quantization != "none"
    weights = stage_weight_bytes(shape, dtype, quantization, num_nodes, prequantized,
                                 linear_dtype(shape, dtype, pool.device))  # fmt: skip
    budget = int(_device_memory_bytes(pool, spec, max(num_gpus, 1)) * engine.kv_cache_memory_fraction)
    return _Attempt(
        quantization=quantization,
        num_gpus=num_gpus,
        num_nodes=num_nodes,
        weight_bytes=weights,
        min_kv_bytes=kv_cache_bytes(shape, dtype, engine.max_model_len, engine.block_size, num_gpus, num_nodes,
                                    engine.kv_cache_dtype),
        # More KV than max_num_seqs full-length sequences can never be used: do not reserve it.
        max_kv_bytes=kv_cache_bytes(shape, dtype, engine.max_model_len * engine.max_num_seqs, engine.block_size,
                                    num_gpus, num_nodes, engine.kv_cache_dtype),
        overhead_bytes=overhead_bytes(weights, num_gpus, encoder_cache_bytes(shape, dtype, _encoder_cache_rows(spec))),
        budget_bytes=budget,
    )


def _gpu_counts(pool: Pool, spec: InferenceSpec, shape: ModelShape) -> tuple[list[int], list[int]]:
    """GPU counts per replica to try, and those the limits allow but the model's heads cannot be split over."""
    if pool.device != "cuda":
        return [0], []
    allowed = [n for n in GPU_COUNTS if n <= min(spec.placement.max_gpus_per_replica, pool.max_gpus_per_node)]
    return [n for n in allowed if splits_heads(shape, n)], [n for n in allowed if not splits_heads(shape, n)]


def _tensor_parallel_note(pool: Pool, chosen: _Attempt, too_small: _Attempt | None) -> str:
    if chosen.num_gpus <= 1:
        return ""
    note = f" (tensor parallel over {chosen.num_gpus} GPUs"
    if too_small is not None:
        note += (
            f": {too_small.num_gpus} x {pool.gpu_product} is not enough, {gib(too_small.needed_bytes)} needed "
            f"but {gib(too_small.budget_bytes)} usable"
        )
    return note + ")"


def _heads_note(shape: ModelShape, unsplittable: list[int]) -> str:
    counts = ", ".join(f"x{n}" for n in unsplittable)
    return f"; {counts} not offered: {why_heads_do_not_split(shape, GPU_COUNTS[-1])}"


def choose_profile(pool: Pool, spec: InferenceSpec, shape: ModelShape) -> PoolChoice:
    """The best profile for `pool`, or the reason there is none."""
    pins = spec.placement.pins
    if pins.device != "auto" and pins.device != pool.device:
        return PoolChoice(pool, None, f"device pinned to {pins.device}")
    dtype, why_not = _dtype_for(pool, pins.dtype)
    if dtype is None:
        return PoolChoice(pool, None, why_not)
    stored = spec.model.checkpoint_quantization
    if stored != "none":  # pre-quantized: loaded as it is, so its precision is the only one on offer
        if pins.quantization not in ("auto", stored):
            return PoolChoice(pool, None, f"the checkpoint is already {stored} (pre-quantized) and is loaded as it "
                              f"is; spec.placement.profile.quantization pins {pins.quantization}")  # fmt: skip
        if stored in spec.placement.forbidden_quantizations:
            return PoolChoice(pool, None, f"the checkpoint is already {stored} (pre-quantized), which "
                              "spec.placement.forbiddenQuantizations forbids")  # fmt: skip
    quantizations = [
        q
        for q in QUANTIZATION_ORDER
        if (pins.quantization in ("auto", q))
        and q not in spec.placement.forbidden_quantizations
        and (stored == "none" or q == stored)
    ]
    gpu_counts, unsplittable = _gpu_counts(pool, spec, shape)
    if stored != "none":  # the runtime loads pre-quantized checkpoints on one device per replica
        gpu_counts = [n for n in gpu_counts if n <= 1]
    pinned = spec.parallelism
    if pinned.tensor is not None or pinned.pipeline is not None:
        why_not = _pinned_layout_problem(pool, spec, shape, stored)
        if why_not:
            return PoolChoice(pool, None, why_not)
        node_counts = [pinned.pipeline or 1]
        if pool.device == "cuda":
            gpu_counts = [pinned.tensor] if pinned.tensor else _node_gpu_counts(pool, shape)
    else:
        node_counts = list(range(1, min(spec.placement.max_nodes_per_replica, pool.num_nodes) + 1))
        if stored != "none":
            node_counts = [1]
    if not gpu_counts:
        return PoolChoice(pool, None, f"no allocatable {pool.gpu_resource} on these nodes")
    found, closest = _search(pool, spec, shape, dtype, quantizations, node_counts, gpu_counts)
    if found is not None:
        choice, skipped = found
        if skipped and unsplittable and choice.profile is not None and not choice.profile.multi_node:
            # Only a fallback makes the counts the heads ruled out worth a word: they are always the largest.
            choice = replace(choice, reason=choice.reason + _heads_note(shape, unsplittable))
        return choice
    if closest is None:
        return PoolChoice(pool, None, "no quantization left to try (all forbidden or pinned away)")
    return PoolChoice(pool, None, _no_fit_reason(pool, spec, shape, dtype, quantizations, closest, unsplittable))


def _node_gpu_counts(pool: Pool, shape: ModelShape) -> list[int]:
    """Tensor-parallel sizes a stage of a group may use: up to every GPU of a node (spec.placement's
    maxGpusPerReplica bounds one-node replicas; a group is there because one node was not enough)."""
    return [n for n in GPU_COUNTS if n <= pool.max_gpus_per_node and splits_heads(shape, n)]


def _pinned_layout_problem(pool: Pool, spec: InferenceSpec, shape: ModelShape, stored: str) -> str:
    """Why spec.parallelism cannot run on `pool` ("" when it can)."""
    tensor, pipeline = spec.parallelism.tensor, spec.parallelism.pipeline or 1
    if pool.device != "cuda" and (tensor or 1) > 1:
        return f"spec.parallelism.tensor is {tensor}, but CPU pools run one rank per node"
    if pool.device == "cuda" and tensor:
        if tensor > pool.max_gpus_per_node:
            gpus = f"{pool.max_gpus_per_node} GPU{'s' if pool.max_gpus_per_node != 1 else ''}"
            return f"spec.parallelism.tensor is {tensor}, but these nodes have {gpus}"
        if not splits_heads(shape, tensor):
            return f"spec.parallelism.tensor is {tensor}: {why_heads_do_not_split(shape, GPU_COUNTS[-1])}"
    if pipeline > pool.num_nodes:
        return f"spec.parallelism.pipeline is {pipeline}, one node per stage, but the pool has {pool.num_nodes} nodes"
    if pipeline > shape.num_layers:
        return f"spec.parallelism.pipeline is {pipeline}, more stages than the model's {shape.num_layers} layers"
    if stored != "none" and (pipeline > 1 or (tensor or 1) > 1):
        return "a pre-quantized checkpoint is loaded on one device per replica: spec.parallelism cannot split it"
    return ""


def _search(
    pool: Pool, spec: InferenceSpec, shape: ModelShape, dtype: str, quantizations: list[str], node_counts: list[int],
    gpu_counts: list[int],
) -> tuple[tuple[PoolChoice, list[str]] | None, _Attempt | None]:
    """The first layout that fits, fewest nodes, then highest precision, then fewest GPUs, with the precisions
    it skipped; else None and the attempt that came closest."""
    closest: _Attempt | None = None
    for num_nodes in node_counts:
        counts = gpu_counts if num_nodes == 1 or pool.device != "cuda" or spec.parallelism.tensor else \
            _node_gpu_counts(pool, shape)  # fmt: skip
        if num_nodes > shape.num_layers:
            break
        for quantization in quantizations:
            too_small: _Attempt | None = None  # the largest GPU count this precision tried and overflowed
            for num_gpus in counts:
                attempt = _attempt(pool, spec, shape, dtype, quantization, num_gpus, num_nodes)
                if closest is None or attempt.shortfall_bytes < closest.shortfall_bytes:
                    closest = attempt
                if attempt.needed_bytes > attempt.budget_bytes:
                    too_small = attempt
                    continue
                skipped = quantizations[: quantizations.index(quantization)]
                return (_fitting_choice(pool, spec, shape, dtype, attempt, too_small, skipped), skipped), closest
    return None, closest


def _fitting_choice(pool: Pool, spec: InferenceSpec, shape: ModelShape, dtype: str, attempt: _Attempt,
                    too_small: _Attempt | None, skipped: list[str]) -> PoolChoice:  # fmt: skip
    engine = spec.engine
    stored = spec.model.checkpoint_quantization
    kv_bytes = min(attempt.budget_bytes - attempt.weight_bytes - attempt.overhead_bytes, attempt.max_kv_bytes)
    profile = Profile(
        device=pool.device,
        dtype=dtype,
        quantization=attempt.quantization,
        num_gpus=attempt.num_gpus,
        weight_bytes=attempt.weight_bytes,
        kv_cache_bytes=kv_bytes,
        overhead_bytes=attempt.overhead_bytes,
        memory_budget_bytes=attempt.budget_bytes,
        prequantized=stored != "none",
        kv_offload_bytes=kv_offload_bytes(pool, spec, attempt.num_gpus, kv_bytes),
        num_nodes=attempt.num_nodes,
        layer_partition=stage_partition(shape, attempt.num_nodes) if attempt.num_nodes > 1 else (),
        kv_cache_dtype=pool_kv_cache_dtype(engine.kv_cache_dtype, dtype),
    )
    per_token = kv_bytes_per_token(shape, dtype, attempt.num_gpus, attempt.num_nodes, profile.kv_cache_dtype)
    if profile.multi_node:
        layout = _pipeline_note(shape, attempt, pinned=spec.parallelism.pipeline is not None)
        weights = "weights per stage"
    else:
        layout = _tensor_parallel_note(pool, attempt, too_small)
        weights = "weights"
    reason = (
        f"{profile.label()}{layout}: {weights} {gib(attempt.weight_bytes)} + min KV {gib(attempt.min_kv_bytes)} "
        f"({engine.max_model_len} tokens x {per_token} B) + overhead {gib(attempt.overhead_bytes)} fit "
        f"{gib(attempt.budget_bytes)} of {pool.describe()}"
    )
    if stored != "none":
        reason += " (a pre-quantized checkpoint, loaded as it is)"
    if profile.kv_offload_bytes:
        reason += f"; host KV tier {gib(profile.kv_offload_bytes)}"
    if skipped:
        reason += f"; {', '.join(skipped)} did not fit"
    return PoolChoice(pool, profile, reason, capacity=_capacity(pool, profile))


def _pipeline_note(shape: ModelShape, attempt: _Attempt, pinned: bool) -> str:
    gpus = f" x {attempt.num_gpus} GPUs" if attempt.num_gpus > 1 else ""
    why = "spec.parallelism" if pinned else "one node holds no precision"
    return (f" ({attempt.num_nodes} nodes per replica, a LeaderWorkerSet group: {attempt.num_nodes} pipeline stages of "
            f"{'+'.join(map(str, stage_partition(shape, attempt.num_nodes)))} layers{gpus}; {why})")  # fmt: skip


def _no_fit_reason(pool: Pool, spec: InferenceSpec, shape: ModelShape, dtype: str, quantizations: list[str],
                   closest: _Attempt, unsplittable: list[int]) -> str:  # fmt: skip
    over = f" over {closest.num_gpus} GPUs" if closest.num_gpus > 1 else ""
    if closest.num_nodes > 1:
        over += f" in {closest.num_nodes} pipeline stages (per stage)"
    if pool.device == "cuda":
        offer = f"{closest.num_gpus} x {pool.gpu_product} offer{'s' if closest.num_gpus == 1 else ''}"
        offer += f" {gib(closest.budget_bytes)} ({pool.describe()})"
    else:
        offer = f"{pool.describe()} offers {gib(closest.budget_bytes)}"
    reason = f"does not fit: even {dtype}/{closest.quantization}{over} needs {gib(closest.needed_bytes)} but {offer}"
    if unsplittable:
        reason += _heads_note(shape, unsplittable)
    beyond_limit = [
        n
        for n in GPU_COUNTS
        if spec.placement.max_gpus_per_replica < n <= pool.max_gpus_per_node and splits_heads(shape, n)
    ]
    if pool.device == "cuda" and beyond_limit:
        reason += (
            f"; these nodes have {pool.max_gpus_per_node} GPUs: raise spec.placement.maxGpusPerReplica (up to "
            f"{beyond_limit[-1]}) to split the model over more of them"
        )
    pinned = spec.parallelism.tensor is not None or spec.parallelism.pipeline is not None
    first_unallowed = spec.placement.max_nodes_per_replica + 1
    if not pinned and spec.model.checkpoint_quantization == "none" and first_unallowed <= pool.num_nodes:
        more = list(range(first_unallowed, min(pool.num_nodes, MAX_PIPELINE_STAGES) + 1))
        found, _ = _search(pool, spec, shape, dtype, quantizations, more, _node_gpu_counts(pool, shape) or [0])
        if found is not None and found[0].profile is not None:
            profile = found[0].profile
            reason += (f"; {profile.num_nodes} nodes per replica would hold it ({profile.label()}): set "
                       f"spec.placement.maxNodesPerReplica to {profile.num_nodes} to run each replica as a "
                       "LeaderWorkerSet group (LWS must be installed)")  # fmt: skip
    return reason
