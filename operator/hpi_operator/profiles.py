"""Profile choice, a pure function: per pool, the highest precision whose memory needs fit the device.

Order of preference: the activation dtype (bf16 where the device supports it, fp16 on pre-Ampere GPUs, fp32
on CPUs without bf16) unquantized, then weight-only int8, then int4; within one precision, the fewest GPUs.
Pins and forbidden quantizations from the spec narrow the candidates. A pool where nothing fits gets no
profile but a reason, so that status can say why it is unused.
"""

from __future__ import annotations

from dataclasses import dataclass

from .nodes import Pool
from .quantities import parse_quantity
from .sizing import (
    ModelShape,
    gib,
    kv_bytes_per_token,
    kv_cache_bytes,
    overhead_bytes,
    weight_bytes,
)
from .spec import InferenceSpec

QUANTIZATION_ORDER = ("none", "int8", "int4")
GPU_COUNTS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Profile:
    """How replicas run on one pool, with the memory arithmetic that justified it."""

    device: str  # cuda | cpu
    dtype: str  # bf16 | fp16 | fp32
    quantization: str  # none | int8 | int4
    num_gpus: int  # per replica; 0 on CPU
    weight_bytes: int
    kv_cache_bytes: int  # what the runtime gets (passed as --kv-cache-memory-bytes)
    overhead_bytes: int
    memory_budget_bytes: int  # the part of the device memory the runtime may fill

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.overhead_bytes

    def label(self) -> str:
        quant = "" if self.quantization == "none" else f"/{self.quantization}"
        gpus = f" x{self.num_gpus}" if self.num_gpus > 1 else ""
        return f"{self.device}:{self.dtype}{quant}{gpus}"


@dataclass(frozen=True)
class PoolChoice:
    """The outcome for one pool: a profile, or none, and a one-line reason a user can read."""

    pool: Pool
    profile: Profile | None
    reason: str
    capacity: int = 0  # replicas the pool's nodes can hold with this profile


def _dtype_for(pool: Pool, pinned: str) -> tuple[str | None, str]:
    if pool.device == "cuda":
        native = "bf16" if pool.gpu_bf16 else "fp16"
        if pinned == "bf16" and not pool.gpu_bf16:
            return None, f"dtype pinned to bf16, which {pool.gpu_product} does not support"
    else:
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


def _capacity(pool: Pool, profile: Profile) -> int:
    if pool.device == "cuda":
        return sum(gpus // profile.num_gpus for gpus in pool.gpus_per_node)
    per_replica = profile.needed_bytes
    return sum(memory // per_replica for memory in pool.memory_bytes_per_node)


def choose_profile(pool: Pool, spec: InferenceSpec, shape: ModelShape) -> PoolChoice:
    """The best profile for `pool`, or the reason there is none."""
    pins = spec.placement.pins
    if pins.device != "auto" and pins.device != pool.device:
        return PoolChoice(pool, None, f"device pinned to {pins.device}")
    dtype, why_not = _dtype_for(pool, pins.dtype)
    if dtype is None:
        return PoolChoice(pool, None, why_not)
    quantizations = [
        q
        for q in QUANTIZATION_ORDER
        if (pins.quantization in ("auto", q)) and q not in spec.placement.forbidden_quantizations
    ]
    if pool.device == "cuda":
        gpu_counts = [n for n in GPU_COUNTS if n <= min(spec.placement.max_gpus_per_replica, pool.max_gpus_per_node)]
        if not gpu_counts:
            return PoolChoice(pool, None, "no allocatable nvidia.com/gpu on these nodes")
    else:
        gpu_counts = [0]
    engine = spec.engine
    min_kv = kv_cache_bytes(shape, dtype, engine.max_model_len, engine.block_size)
    # More KV than max_num_seqs full-length sequences can never be used: do not reserve it.
    max_kv = kv_cache_bytes(shape, dtype, engine.max_model_len * engine.max_num_seqs, engine.block_size)
    smallest_need = None
    for quantization in quantizations:
        weights = weight_bytes(shape, dtype, quantization)
        for num_gpus in gpu_counts:
            budget = int(_device_memory_bytes(pool, spec, max(num_gpus, 1)) * engine.kv_cache_memory_fraction)
            overhead = overhead_bytes(weights, num_gpus)
            need = weights + min_kv + overhead
            if smallest_need is None or need < smallest_need[0]:
                smallest_need = (need, quantization, budget)
            if need > budget:
                continue
            profile = Profile(
                device=pool.device,
                dtype=dtype,
                quantization=quantization,
                num_gpus=num_gpus,
                weight_bytes=weights,
                kv_cache_bytes=min(budget - weights - overhead, max_kv),
                overhead_bytes=overhead,
                memory_budget_bytes=budget,
            )
            reason = (
                f"{profile.label()}: weights {gib(weights)} + min KV {gib(min_kv)} "
                f"({engine.max_model_len} tokens x {kv_bytes_per_token(shape, dtype)} B) + overhead "
                f"{gib(overhead)} fit {gib(budget)} of {pool.describe()}"
            )
            skipped = quantizations[: quantizations.index(quantization)]
            if skipped:
                reason += f"; {', '.join(skipped)} did not fit"
            return PoolChoice(pool, profile, reason, capacity=_capacity(pool, profile))
    if smallest_need is None:
        return PoolChoice(pool, None, "no quantization left to try (all forbidden or pinned away)")
    need, quantization, budget = smallest_need
    return PoolChoice(
        pool,
        None,
        f"does not fit: even {dtype}/{quantization} needs {gib(need)} but {pool.describe()} "
        f"offers {gib(budget)}",
    )
