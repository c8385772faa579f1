"""The InferenceDeployment spec as frozen dataclasses: parsed once, defaults applied, checked beyond the schema.

The CRD's openAPIV3Schema catches types, enums and bounds on a real API server, and declares every default:
the API server fills them in, `parse_spec` fills them in the same way for a spec no server has seen
(crd_defaults.py), and the dataclasses take their field defaults from the CRD too. No default is restated here.
Rules the schema cannot express raise `SpecError`, which the reconciler turns into a Degraded condition.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils import parse_quantity

from hpi_contracts.kv_cache import BLOCK_SIZES, KV_CACHE_DTYPES

from .adapter_spec import AdapterSpec, parse_adapters
from .crd_defaults import crd_default, with_defaults
from .fleet.performance import Slo
from .fleet.settings import PoolSettings, parse_pools, parse_slo

MODEL_SOURCES = ("embedded", "pvc", "huggingface")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bf16", "fp16", "fp32")
CHECKPOINT_DTYPES = ("bf16", "fp16", "fp32")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
AUTOSCALING_MODES = ("builtin", "hpa", "keda", "optimizer")
ROUTING_MODES = ("router", "inferencePool", "service")
PROFILING_MODES = ("auto", "always", "never")
ENDPOINT_PICKER_FAILURE_MODES = ("FailOpen", "FailClose")
CACHE_VOLUMES = ("persistentVolumeClaim", "hostPath")
CACHE_ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce")
LORA_DTYPES = ("auto", "bfloat16")  # spec.engine.loraDtype: the runtime's --lora-dtype that every pool runs
MAX_PIPELINE_STAGES = 64  # nodes one replica may span (spec.parallelism.pipeline, placement.maxNodesPerReplica)

FALLING_WINDOW_POLLS = 2  # the optimizer's scale-down window while the demand falls (scale_down_window_s)
HPA_SCALE_DOWN_WINDOW_S = 300  # HPA's behavior.scaleDown.stabilizationWindowSeconds default: the KV modes'
_PARAM_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class SpecError(ValueError):
    """The spec is well-typed but cannot be served as written; the message says which field and why."""


@dataclass(frozen=True)
class ModelSize:
    """Size hints for the memory arithmetic when the operator cannot read the model's config.json."""

    num_parameters: int | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    num_heads: int | None = None  # query heads; without it tensor parallelism stops at num_kv_heads GPUs
    num_vision_parameters: int | None = None  # a vision-language model's vision tower and projector (sizing.py)
    checkpoint_dtype: str | None = None  # "bf16", "fp16" or "fp32": config.json's torch_dtype
    tie_word_embeddings: bool | None = None  # config.json's: the LM head is the embedding


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class CacheSpec:
    """spec.model.cache: where a Hugging Face model is downloaded once instead of in every pod."""

    enabled: bool = crd_default("model.cache.enabled")
    volume: str = crd_default("model.cache.volume")  # or hostPath: node-local, each node fills its own copy
    claim_name: str | None = None  # an existing claim; None: the operator creates <name>-model-cache
    size: str | None = None  # None: computed from the checkpoint
    storage_class: str | None = None
    access_mode: str = crd_default("model.cache.accessMode")
    host_path: str = crd_default("model.cache.hostPath")


@dataclass(frozen=True)
class ModelSpec:
    source: str = crd_default("model.source")
    served_name: str | None = None
    pvc_claim_name: str | None = None
    pvc_path: str = crd_default("model.pvc.path")
    hf_id: str | None = None
    hf_revision: str = crd_default("model.huggingface.revision")
    hf_token_secret: SecretKeyRef | None = None
    size: ModelSize = field(default_factory=ModelSize)
    cache: CacheSpec = field(default_factory=CacheSpec)
    # The weights as stored: int8/int4 for a pre-quantized GPTQ, AWQ or compressed-tensors checkpoint, which the
    # runtime loads as it is (sized by its real bytes, never given another quantization profile).
    checkpoint_quantization: str = "none"


@dataclass(frozen=True)
class RuntimeSpec:
    image: str = crd_default("runtime.image")
    rocm_image: str = crd_default("runtime.rocmImage")  # for AMD GPU pools (manifests.runtime_image)
    image_pull_policy: str = crd_default("runtime.imagePullPolicy")
    image_pull_secrets: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    drain_timeout_s: int = crd_default("runtime.drainTimeoutSeconds")


@dataclass(frozen=True)
class EngineSpec:
    max_model_len: int = crd_default("engine.maxModelLen")
    max_num_seqs: int = crd_default("engine.maxNumSeqs")
    max_num_batched_tokens: int | None = None
    kv_cache_memory_fraction: float = crd_default("engine.kvCacheMemoryFraction")
    block_size: int = crd_default("engine.blockSize")
    kv_cache_dtype: str = crd_default("engine.kvCacheDtype")  # the runtime's --kv-cache-dtype
    kv_offload_bytes: int | None = None  # the host KV tier per replica; None: "auto" (profiles.py decides)
    max_loras: int = crd_default("engine.maxLoras")  # with spec.adapters: adapters one batch holds
    max_lora_rank: int = crd_default("engine.maxLoraRank")
    max_cpu_loras: int | None = None  # None: as many as spec.adapters lists, at least max_loras
    lora_dtype: str = crd_default("engine.loraDtype")  # the runtime's --lora-dtype


@dataclass(frozen=True)
class ProfilePins:
    device: str = crd_default("placement.profile.device")
    dtype: str = crd_default("placement.profile.dtype")
    quantization: str = crd_default("placement.profile.quantization")


@dataclass(frozen=True)
class PlacementSpec:
    allowed_pools: tuple[str, ...] = ()  # empty: every pool is allowed
    preferred_pools: tuple[str, ...] = ()  # filled first, in this order
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    max_gpus_per_replica: int = crd_default("placement.maxGpusPerReplica")
    # Nodes one replica may span: pipeline stages across nodes, run as a LeaderWorkerSet group (profiles.py).
    max_nodes_per_replica: int = crd_default("placement.maxNodesPerReplica")
    pins: ProfilePins = field(default_factory=ProfilePins)
    forbidden_quantizations: tuple[str, ...] = ()
    pools: tuple[PoolSettings, ...] = ()  # per-pool price, bounds and performance (the fleet optimizer's)
    profiling: str = crd_default("placement.profiling")  # auto | always | never: measure pools (profiling.py)

    def pool(self, name: str) -> PoolSettings:
        return next((p for p in self.pools if p.name == name), PoolSettings(name))


@dataclass(frozen=True)
class AutoscalingSpec:
    """Read by the autoscaler (builtin timer, or rendered HPA/KEDA objects); the reconciler only validates it."""

    enabled: bool = crd_default("autoscaling.enabled")
    mode: str = crd_default("autoscaling.mode")
    min_replicas: int = crd_default("autoscaling.minReplicas")
    max_replicas: int = crd_default("autoscaling.maxReplicas")
    target_kv_utilization: float = crd_default("autoscaling.targetKVUtilization")
    target_waiting_requests: int | None = None
    scale_up_stabilization_s: int = crd_default("autoscaling.scaleUpStabilizationSeconds")
    # None: by mode, scale_down_window_s (the CRD cannot declare a default that depends on the mode)
    scale_down_stabilization_s: int | None = None
    max_scale_step: int = crd_default("autoscaling.maxScaleStep")
    poll_interval_s: int = crd_default("autoscaling.pollIntervalSeconds")
    lead_time_s: int | None = None  # optimizer: plan this far ahead on a rise; None: the pools' start + 2 polls
    # optimizer: the share of each replica's capacity within the SLO the plan fills (fleet/optimizer.py)
    target_capacity_utilization: float = crd_default("autoscaling.targetCapacityUtilization")
    scale_to_zero: bool = crd_default("autoscaling.scaleToZero.enabled")
    scale_to_zero_idle_s: int = crd_default("autoscaling.scaleToZero.idleSeconds")
    # 0: to zero replicas; 1 or 2: the pods stay and sleep at that level (autoscaling/sleep.py)
    sleep_level: int = crd_default("autoscaling.scaleToZero.sleepLevel")

    def scale_down_window_s(self, lead_s: float | None = None, falling: bool = False) -> float:
        """The scale-down stabilization window in effect: scaleDownStabilizationSeconds when set; else in optimizer
        mode `lead_s`, its lead time (fleet/forecast.py), when known, or FALLING_WINDOW_POLLS polls while the
        demand's trend is `falling` (forecast.falling); else HPA's default. The optimizer's default: a replica
        released sooner than one takes to start is missed if the demand returns, and one held longer is paid for
        idle; on the fleet simulator's day (bench/results/fleet.md) windows from 60 s to 150 s held 99% at 9-13%
        less cost than HPA's 300 s. On a falling trend the demand is not expected back within a start time, and the
        lead-long window only holds the last lead's higher plans: two polls (what one reading's noise needs) cut
        the day's cost 5% at the same attainment there."""
        if self.scale_down_stabilization_s is not None:
            return self.scale_down_stabilization_s
        if self.mode == "optimizer" and lead_s is not None:
            return min(FALLING_WINDOW_POLLS * self.poll_interval_s, lead_s) if falling else lead_s
        return HPA_SCALE_DOWN_WINDOW_S


@dataclass(frozen=True)
class RoutingSpec:
    """spec.routing: what stands between clients and the runtime pods (routing_manifests.py builds it)."""

    mode: str | None = None  # None: not set, `effective_mode` decides
    router_image: str = crd_default("routing.router.image")
    router_replicas: int = crd_default("routing.router.replicas")
    router_resources: Mapping[str, Any] = field(default_factory=dict)  # empty: the builder's defaults
    tenants_secret: SecretKeyRef | None = None  # the router's tenants file (API keys per tenant)
    endpoint_picker_image: str = crd_default("routing.inferencePool.endpointPickerImage")
    # The gateway's behaviour when the endpoint picker does not answer.
    failure_mode: str = crd_default("routing.inferencePool.failureMode")


@dataclass(frozen=True)
class NetworkPolicySpec:
    """spec.networkPolicy: who may call the pods (network_policies.py builds the policies). The peers are
    NetworkPolicyPeer objects as Kubernetes spells them, passed through after a shape check."""

    enabled: bool = crd_default("networkPolicy.enabled")
    clients: tuple[Mapping[str, Any], ...] = tuple(crd_default("networkPolicy.clients"))
    prometheus: tuple[Mapping[str, Any], ...] = tuple(crd_default("networkPolicy.prometheus"))
    gateway: tuple[Mapping[str, Any], ...] = tuple(crd_default("networkPolicy.gateway"))


@dataclass(frozen=True)
class ParallelismSpec:
    """spec.parallelism: a replica's layout pinned, as vLLM's flags say it: `tensor` ranks on each node (GPUs per
    node, 1 on CPU) and `pipeline` stages, one node each. None: the operator chooses (profiles.py)."""

    tensor: int | None = None
    pipeline: int | None = None


@dataclass(frozen=True)
class InferenceSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    replicas: int = crd_default("replicas")
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    placement: PlacementSpec = field(default_factory=PlacementSpec)
    resources: Mapping[str, Any] = field(default_factory=dict)
    api_key_secret: SecretKeyRef | None = None
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    slo: Slo | None = None
    network_policy: NetworkPolicySpec = field(default_factory=NetworkPolicySpec)
    adapters: tuple[AdapterSpec, ...] = ()  # LoRA adapters (adapters.py)
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)

    @property
    def optimized(self) -> bool:
        """Replicas per pool come from the fleet optimizer (autoscaling mode optimizer), not spec.replicas."""
        return self.autoscaling.enabled and self.autoscaling.mode == "optimizer"

    @property
    def profiled(self) -> bool:
        """Pools are measured and their figures handed to the pods (spec.placement.profiling; auto: where the
        fleet optimizer uses them)."""
        return self.placement.profiling == "always" or (self.placement.profiling == "auto" and self.optimized)


def effective_routing_mode(spec: InferenceSpec, num_pools: int) -> str:
    """spec.routing.mode, or when unset: `router` for anything that can run more than one replica (more than
    one pool, more than one replica, or an autoscaler allowed past one) or that has tenants (only the router
    checks their keys), else a plain `service`.

    The autoscaler's ceiling counts, not only today's replicas: a scaler moving 1 <-> 2 must not switch the
    routing objects back and forth."""
    if spec.routing.mode:
        return spec.routing.mode
    ceiling = max(spec.replicas, spec.autoscaling.max_replicas if spec.autoscaling.enabled else 0)
    return "router" if num_pools > 1 or ceiling > 1 or spec.routing.tenants_secret else "service"


def parse_parameter_count(value: int | str | None) -> int | None:
    """`8030261248`, `"8B"`, `"1.7B"`, `"135M"` -> a parameter count."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMBT]?)\s*", str(value), flags=re.IGNORECASE)
    if not match:
        raise SpecError(f"spec.model.size.parameters: {value!r} is not a count like 8030261248, '8B' or '135M'")
    number, suffix = match.groups()
    return round(float(number) * _PARAM_SUFFIXES.get(suffix.upper(), 1))


def _get(mapping: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    value = (mapping or {}).get(key)
    return default if value is None else value


def _head_count(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"spec.model.size.{key} must be a positive integer; got {value!r}")
    return value


def _parse_size(raw: Mapping[str, Any]) -> ModelSize:
    size = ModelSize(
        num_parameters=parse_parameter_count(raw.get("parameters")),
        num_layers=raw.get("numLayers"),
        num_kv_heads=_head_count(raw, "numKVHeads"),
        head_dim=raw.get("headDim"),
        hidden_size=raw.get("hiddenSize"),
        vocab_size=raw.get("vocabSize"),
        num_heads=_head_count(raw, "numHeads"),
        num_vision_parameters=parse_parameter_count(raw.get("visionParameters")),
        checkpoint_dtype=raw.get("checkpointDtype"),
        tie_word_embeddings=raw.get("tieWordEmbeddings"),
    )
    if size.checkpoint_dtype is not None and size.checkpoint_dtype not in CHECKPOINT_DTYPES:
        raise SpecError(f"spec.model.size.checkpointDtype must be one of {', '.join(CHECKPOINT_DTYPES)}; got "
                        f"{size.checkpoint_dtype!r}")  # fmt: skip
    if size.tie_word_embeddings is not None and not isinstance(size.tie_word_embeddings, bool):
        raise SpecError(f"spec.model.size.tieWordEmbeddings must be true or false; got {size.tie_word_embeddings!r}")
    if size.num_vision_parameters and size.num_parameters and size.num_vision_parameters >= size.num_parameters:
        raise SpecError("spec.model.size.visionParameters counts part of spec.model.size.parameters, so it must be "
                        "smaller")  # fmt: skip
    if size.num_heads and size.num_kv_heads and size.num_heads % size.num_kv_heads:
        raise SpecError(
            f"spec.model.size.numKVHeads ({size.num_kv_heads}) must divide spec.model.size.numHeads "
            f"({size.num_heads}): each KV head serves a whole group of query heads"
        )
    return size


def _secret_ref(raw: Mapping[str, Any] | None, schema_path: str) -> SecretKeyRef | None:
    if not raw:
        return None
    if not raw.get("name"):
        raise SpecError(f"spec.{schema_path}.name is required")
    return SecretKeyRef(name=raw["name"], key=_get(raw, "key", crd_default(f"{schema_path}.key")))


def _parse_model(raw: Mapping[str, Any]) -> ModelSpec:
    source = _get(raw, "source", ModelSpec.source)
    if source not in MODEL_SOURCES:
        raise SpecError(f"spec.model.source must be one of {', '.join(MODEL_SOURCES)}; got {source!r}")
    size = _parse_size(_get(raw, "size", {}))
    pvc = _get(raw, "pvc", {})
    hf = _get(raw, "huggingface", {})
    if source == "pvc" and not pvc.get("claimName"):
        raise SpecError("spec.model.source is pvc but spec.model.pvc.claimName is missing")
    if source == "huggingface" and not hf.get("id"):
        raise SpecError("spec.model.source is huggingface but spec.model.huggingface.id is missing")
    pvc_path = str(_get(pvc, "path", ModelSpec.pvc_path)).strip("/")
    if ".." in pvc_path.split("/"):
        raise SpecError(f"spec.model.pvc.path must stay inside the volume; got {pvc_path!r}")
    revision = str(_get(hf, "revision", ModelSpec.hf_revision))
    if not re.fullmatch(r"[A-Za-z0-9][-A-Za-z0-9_./]*", revision) or ".." in revision.split("/"):
        raise SpecError(f"spec.model.huggingface.revision must be a branch, tag or commit; got {revision!r}")
    checkpoint_quantization = str(_get(raw, "checkpointQuantization", crd_default("model.checkpointQuantization")))
    if checkpoint_quantization not in CHECKPOINT_QUANTIZATIONS:
        raise SpecError(f"spec.model.checkpointQuantization must be one of {', '.join(CHECKPOINT_QUANTIZATIONS)}; "
                        f"got {checkpoint_quantization!r}")  # fmt: skip
    if checkpoint_quantization == "auto":
        checkpoint_quantization = detect_checkpoint_quantization(hf.get("id") if source == "huggingface" else None)
    cache = _parse_cache(_get(raw, "cache", {}))
    if cache.enabled and source != "huggingface":
        raise SpecError(f"spec.model.cache is for source huggingface (a download to cache); source is {source}")
    return ModelSpec(
        source=source,
        served_name=raw.get("servedName"),
        pvc_claim_name=pvc.get("claimName"),
        pvc_path=pvc_path,
        hf_id=hf.get("id"),
        hf_revision=revision,
        hf_token_secret=_secret_ref(hf.get("tokenSecretRef"), "model.huggingface.tokenSecretRef"),
        size=size,
        cache=cache,
        checkpoint_quantization=checkpoint_quantization,
    )


CHECKPOINT_QUANTIZATIONS = ("auto", "none", "int8", "int4")
# How the Hub names pre-quantized checkpoints (e.g. Qwen2.5-7B-Instruct-AWQ, ...-GPTQ-Int8,
# Meta-Llama-3.1-8B-Instruct-quantized.w4a16): the method, then optionally the bits.
_PREQUANTIZED_NAME = re.compile(r"[-_.](awq|gptq|w4a16|w8a16)([-_.].*)?$", re.IGNORECASE)


def detect_checkpoint_quantization(hf_id: str | None) -> str:
    """int8/int4 when a Hugging Face id names a GPTQ, AWQ or compressed-tensors W4A16/W8A16 checkpoint."""
    if not hf_id:
        return "none"
    match = _PREQUANTIZED_NAME.search(hf_id.rsplit("/", 1)[-1])
    if match is None:
        return "none"
    method, rest = match.group(1).lower(), (match.group(2) or "").lower()
    if method == "w8a16" or (method == "gptq" and re.search(r"int8|8bit|8-bit", rest)):
        return "int8"
    return "int4"


def base_model_name(hf_id: str) -> str:
    """The lower-case model name without the org and without a pre-quantized suffix (for the known shapes)."""
    name = hf_id.rsplit("/", 1)[-1]
    return _PREQUANTIZED_NAME.sub("", name).removesuffix("-quantized").lower()


def _positive_quantity(value: str) -> bool:
    try:
        return parse_quantity(value) > 0
    except ValueError:
        return False


def _parse_cache(raw: Mapping[str, Any]) -> CacheSpec:
    defaults = CacheSpec()
    cache = CacheSpec(
        enabled=bool(_get(raw, "enabled", defaults.enabled)),
        volume=_get(raw, "volume", defaults.volume),
        claim_name=raw.get("claimName") or None,
        size=str(raw["size"]) if raw.get("size") is not None else None,
        storage_class=raw.get("storageClassName") or None,
        access_mode=_get(raw, "accessMode", defaults.access_mode),
        host_path=_get(raw, "hostPath", defaults.host_path),
    )
    if cache.volume not in CACHE_VOLUMES:
        raise SpecError(f"spec.model.cache.volume must be one of {', '.join(CACHE_VOLUMES)}; got {cache.volume!r}")
    if cache.access_mode not in CACHE_ACCESS_MODES:
        raise SpecError(f"spec.model.cache.accessMode must be one of {', '.join(CACHE_ACCESS_MODES)}")
    if cache.volume == "hostPath" and (not cache.host_path.startswith("/") or ".." in cache.host_path.split("/")):
        raise SpecError(f"spec.model.cache.hostPath must be an absolute path; got {cache.host_path!r}")
    if cache.volume == "hostPath" and (cache.claim_name or cache.size or cache.storage_class):
        raise SpecError("spec.model.cache: claimName, size and storageClassName are for volume persistentVolumeClaim")
    if cache.size is not None and not _positive_quantity(cache.size):
        raise SpecError(f"spec.model.cache.size must be a positive quantity like 40Gi; got {cache.size!r}")
    return cache


def _kv_offload_bytes(value: Any) -> int | None:
    if value == "auto":
        return None
    try:
        num_bytes = parse_quantity(value)
    except ValueError:
        num_bytes = -1
    if num_bytes < 0:
        raise SpecError(f"spec.engine.kvOffloadMemory must be 'auto' or a quantity like 32Gi (0: off); got {value!r}")
    return int(num_bytes)


def _parse_engine(raw: Mapping[str, Any]) -> EngineSpec:
    engine = EngineSpec(
        max_model_len=int(_get(raw, "maxModelLen", EngineSpec.max_model_len)),
        max_num_seqs=int(_get(raw, "maxNumSeqs", EngineSpec.max_num_seqs)),
        max_num_batched_tokens=raw.get("maxNumBatchedTokens"),
        kv_cache_memory_fraction=float(_get(raw, "kvCacheMemoryFraction", EngineSpec.kv_cache_memory_fraction)),
        block_size=int(_get(raw, "blockSize", EngineSpec.block_size)),
        kv_cache_dtype=str(_get(raw, "kvCacheDtype", EngineSpec.kv_cache_dtype)),
        kv_offload_bytes=_kv_offload_bytes(raw.get("kvOffloadMemory", "auto")),
        max_loras=int(_get(raw, "maxLoras", EngineSpec.max_loras)),
        max_lora_rank=int(_get(raw, "maxLoraRank", EngineSpec.max_lora_rank)),
        max_cpu_loras=raw.get("maxCpuLoras"),
        lora_dtype=str(_get(raw, "loraDtype", EngineSpec.lora_dtype)),
    )
    if engine.block_size not in BLOCK_SIZES:
        raise SpecError(f"spec.engine.blockSize must be one of {BLOCK_SIZES}; got {engine.block_size}")
    if engine.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise SpecError(f"spec.engine.kvCacheDtype must be one of {KV_CACHE_DTYPES}; got {engine.kv_cache_dtype!r}")
    if engine.lora_dtype not in LORA_DTYPES:
        raise SpecError(f"spec.engine.loraDtype must be one of {LORA_DTYPES}; got {engine.lora_dtype!r}")
    if not 0.0 < engine.kv_cache_memory_fraction < 1.0:
        raise SpecError("spec.engine.kvCacheMemoryFraction must lie strictly between 0 and 1")
    if engine.max_model_len < 1 or engine.max_num_seqs < 1:
        raise SpecError("spec.engine.maxModelLen and spec.engine.maxNumSeqs must be at least 1")
    return engine


def _parse_placement(raw: Mapping[str, Any]) -> PlacementSpec:
    pins_raw = _get(raw, "profile", {})
    pins = ProfilePins(
        device=_get(pins_raw, "device", ProfilePins.device),
        dtype=_get(pins_raw, "dtype", ProfilePins.dtype),
        quantization=_get(pins_raw, "quantization", ProfilePins.quantization),
    )
    for name, value, allowed in (
        ("device", pins.device, DEVICES),
        ("dtype", pins.dtype, DTYPES),
        ("quantization", pins.quantization, QUANTIZATIONS),
    ):
        if value not in allowed:
            raise SpecError(f"spec.placement.profile.{name} must be one of {', '.join(allowed)}; got {value!r}")
    forbidden = tuple(_get(raw, "forbiddenQuantizations", ()))
    for quantization in forbidden:
        if quantization not in QUANTIZATIONS[1:]:
            raise SpecError(f"spec.placement.forbiddenQuantizations: unknown quantization {quantization!r}")
    if pins.quantization in forbidden:
        raise SpecError(
            f"spec.placement.profile.quantization pins {pins.quantization!r}, "
            "which spec.placement.forbiddenQuantizations forbids"
        )
    if set(forbidden) >= {"none", "int8", "int4"}:
        raise SpecError("spec.placement.forbiddenQuantizations forbids every quantization")
    if pins.device == "cpu" and pins.dtype == "fp16":
        raise SpecError("spec.placement.profile: fp16 is not offered on CPU; use bf16 or fp32")
    allowed = tuple(_get(raw, "allowedPools", ()))
    preferred = tuple(_get(raw, "preferredPools", ()))
    if allowed and not set(preferred) <= set(allowed):
        outside = sorted(set(preferred) - set(allowed))
        raise SpecError(f"spec.placement.preferredPools names pools outside allowedPools: {', '.join(outside)}")
    max_gpus = int(_get(raw, "maxGpusPerReplica", PlacementSpec.max_gpus_per_replica))
    if max_gpus not in (1, 2, 4, 8):
        raise SpecError(f"spec.placement.maxGpusPerReplica must be 1, 2, 4 or 8; got {max_gpus}")
    max_nodes = int(_get(raw, "maxNodesPerReplica", PlacementSpec.max_nodes_per_replica))
    if not 1 <= max_nodes <= MAX_PIPELINE_STAGES:
        raise SpecError(f"spec.placement.maxNodesPerReplica must be 1 to {MAX_PIPELINE_STAGES}; got {max_nodes}")
    return PlacementSpec(
        allowed_pools=allowed,
        preferred_pools=preferred,
        node_selector=dict(_get(raw, "nodeSelector", {})),
        tolerations=tuple(_get(raw, "tolerations", ())),
        max_gpus_per_replica=max_gpus,
        max_nodes_per_replica=max_nodes,
        pins=pins,
        forbidden_quantizations=forbidden,
        pools=_fleet(parse_pools, raw.get("pools")),
        profiling=_profiling(_get(raw, "profiling", PlacementSpec.profiling)),
    )


def _parse_parallelism(raw: Mapping[str, Any] | None) -> ParallelismSpec:
    raw = raw or {}
    tensor, pipeline = raw.get("tensor"), raw.get("pipeline")
    if tensor is not None and int(tensor) not in (1, 2, 4, 8):
        raise SpecError(f"spec.parallelism.tensor must be 1, 2, 4 or 8; got {tensor}")
    if pipeline is not None and not 1 <= int(pipeline) <= MAX_PIPELINE_STAGES:
        raise SpecError(f"spec.parallelism.pipeline must be 1 to {MAX_PIPELINE_STAGES}; got {pipeline}")
    return ParallelismSpec(tensor=None if tensor is None else int(tensor),
                           pipeline=None if pipeline is None else int(pipeline))  # fmt: skip


def _profiling(value: Any) -> str:
    if value not in PROFILING_MODES:
        raise SpecError(f"spec.placement.profiling must be one of {', '.join(PROFILING_MODES)}; got {value!r}")
    return str(value)


def _fleet(parse: Any, raw: Any) -> Any:
    try:
        return parse(raw)
    except (ValueError, TypeError) as e:
        raise SpecError(str(e)) from e


def _parse_autoscaling(raw: Mapping[str, Any]) -> AutoscalingSpec:
    defaults = AutoscalingSpec()
    scale_to_zero = _get(raw, "scaleToZero", {})
    spec = AutoscalingSpec(
        enabled=bool(_get(raw, "enabled", defaults.enabled)),
        mode=_get(raw, "mode", defaults.mode),
        min_replicas=int(_get(raw, "minReplicas", defaults.min_replicas)),
        max_replicas=int(_get(raw, "maxReplicas", defaults.max_replicas)),
        target_kv_utilization=float(_get(raw, "targetKVUtilization", defaults.target_kv_utilization)),
        target_waiting_requests=raw.get("targetWaitingRequests"),
        scale_up_stabilization_s=int(_get(raw, "scaleUpStabilizationSeconds", defaults.scale_up_stabilization_s)),
        scale_down_stabilization_s=None if raw.get("scaleDownStabilizationSeconds") is None
        else int(raw["scaleDownStabilizationSeconds"]),
        max_scale_step=int(_get(raw, "maxScaleStep", defaults.max_scale_step)),
        poll_interval_s=int(_get(raw, "pollIntervalSeconds", defaults.poll_interval_s)),
        lead_time_s=None if raw.get("leadTimeSeconds") is None else int(raw["leadTimeSeconds"]),
        target_capacity_utilization=float(_get(raw, "targetCapacityUtilization",
                                               defaults.target_capacity_utilization)),
        scale_to_zero=bool(_get(scale_to_zero, "enabled", defaults.scale_to_zero)),
        scale_to_zero_idle_s=int(_get(scale_to_zero, "idleSeconds", defaults.scale_to_zero_idle_s)),
        sleep_level=_get(scale_to_zero, "sleepLevel", defaults.sleep_level),
    )
    if spec.mode not in AUTOSCALING_MODES:
        raise SpecError(f"spec.autoscaling.mode must be one of {', '.join(AUTOSCALING_MODES)}; got {spec.mode!r}")
    if spec.min_replicas > spec.max_replicas:
        raise SpecError(f"spec.autoscaling.minReplicas ({spec.min_replicas}) exceeds maxReplicas ({spec.max_replicas})")
    if spec.min_replicas == 0 and not spec.scale_to_zero:
        raise SpecError("spec.autoscaling.minReplicas is 0 but spec.autoscaling.scaleToZero.enabled is false")
    if not 0.0 < spec.target_kv_utilization <= 1.0:
        raise SpecError("spec.autoscaling.targetKVUtilization must lie in (0, 1]")
    if not 0.0 < spec.target_capacity_utilization <= 1.0:
        raise SpecError("spec.autoscaling.targetCapacityUtilization must lie in (0, 1]")
    if isinstance(spec.sleep_level, bool) or spec.sleep_level not in (0, 1, 2):
        raise SpecError(f"spec.autoscaling.scaleToZero.sleepLevel must be 0, 1 or 2; got {spec.sleep_level!r}")
    if spec.sleep_level and spec.mode != "builtin":
        raise SpecError("spec.autoscaling.scaleToZero.sleepLevel 1 or 2 needs mode builtin (the operator puts the "
                        f"pods to sleep; mode {spec.mode} scales the Deployment itself)")
    return spec


def _parse_routing(raw: Mapping[str, Any]) -> RoutingSpec:
    defaults = RoutingSpec()
    router = _get(raw, "router", {})
    pool = _get(raw, "inferencePool", {})
    routing = RoutingSpec(
        mode=raw.get("mode") or None,
        router_image=_get(router, "image", defaults.router_image),
        router_replicas=_get(router, "replicas", defaults.router_replicas),
        router_resources=dict(_get(router, "resources", {})),
        tenants_secret=_secret_ref(router.get("tenantsSecretRef"), "routing.router.tenantsSecretRef"),
        endpoint_picker_image=_get(pool, "endpointPickerImage", defaults.endpoint_picker_image),
        failure_mode=_get(pool, "failureMode", defaults.failure_mode),
    )
    if routing.mode is not None and routing.mode not in ROUTING_MODES:
        raise SpecError(f"spec.routing.mode must be one of {', '.join(ROUTING_MODES)}; got {routing.mode!r}")
    replicas = routing.router_replicas
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise SpecError(f"spec.routing.router.replicas must be a positive integer; got {replicas!r}")
    if routing.failure_mode not in ENDPOINT_PICKER_FAILURE_MODES:
        raise SpecError(
            f"spec.routing.inferencePool.failureMode must be one of {', '.join(ENDPOINT_PICKER_FAILURE_MODES)}; "
            f"got {routing.failure_mode!r}"
        )
    if not str(routing.router_image).strip():
        raise SpecError("spec.routing.router.image must not be empty")
    if not str(routing.endpoint_picker_image).strip():
        raise SpecError("spec.routing.inferencePool.endpointPickerImage must not be empty")
    return routing


_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def _label_selector(raw: Any, where: str) -> None:
    """A LabelSelector's shape: what the API server would refuse, caught here with the field's path."""
    if not isinstance(raw, Mapping) or set(raw) - {"matchLabels", "matchExpressions"}:
        raise SpecError(f"{where} must be a label selector (matchLabels, matchExpressions); got {raw!r}")
    labels = raw.get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise SpecError(f"{where}.matchLabels must map label keys to string values; got {labels!r}")
    expressions = raw.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise SpecError(f"{where}.matchExpressions must be a list; got {expressions!r}")
    for i, term in enumerate(expressions):
        if not isinstance(term, Mapping) or not isinstance(term.get("key"), str) or \
                term.get("operator") not in _SELECTOR_OPERATORS:
            raise SpecError(f"{where}.matchExpressions[{i}] needs a key and an operator "
                            f"({', '.join(_SELECTOR_OPERATORS)}); got {term!r}")  # fmt: skip
        values = term.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise SpecError(f"{where}.matchExpressions[{i}].values must be a list of strings; got {values!r}")
        if bool(values) != (term["operator"] in ("In", "NotIn")):
            raise SpecError(f"{where}.matchExpressions[{i}]: operators In and NotIn need values, Exists and "
                            "DoesNotExist take none")  # fmt: skip


def _peers(raw: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    """NetworkPolicyPeers, checked as the API server would check them, so that garbage is a Degraded condition
    naming the field rather than an apply that fails on every reconcile."""
    if not isinstance(raw, list):
        raise SpecError(f"{where} must be a list of NetworkPolicyPeers; got {raw!r}")
    for i, peer in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(peer, Mapping) or not peer:
            raise SpecError(f"{at} must be a NetworkPolicyPeer (podSelector, namespaceSelector and/or ipBlock); "
                            f"got {peer!r}")  # fmt: skip
        unknown = set(peer) - {"podSelector", "namespaceSelector", "ipBlock"}
        if unknown:
            raise SpecError(f"{at} has unknown fields {sorted(unknown)}: a NetworkPolicyPeer has podSelector, "
                            "namespaceSelector and ipBlock")  # fmt: skip
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            if len(peer) > 1:
                raise SpecError(f"{at}: ipBlock cannot be combined with podSelector or namespaceSelector")
            if not isinstance(block, Mapping) or not isinstance(block.get("cidr"), str) or \
                    not all(isinstance(c, str) for c in block.get("except") or []):
                raise SpecError(f"{at}.ipBlock needs a cidr string (and optionally except, CIDR strings); "
                                f"got {block!r}")  # fmt: skip
        for key in ("podSelector", "namespaceSelector"):
            if key in peer:
                _label_selector(peer[key], f"{at}.{key}")
    return tuple(raw)


def _parse_network_policy(raw: Mapping[str, Any]) -> NetworkPolicySpec:
    enabled = raw.get("enabled", NetworkPolicySpec.enabled)
    if not isinstance(enabled, bool):
        raise SpecError(f"spec.networkPolicy.enabled must be true or false; got {enabled!r}")
    defaults = NetworkPolicySpec()
    return NetworkPolicySpec(
        enabled=enabled,
        clients=_peers(_get(raw, "clients", list(defaults.clients)), "spec.networkPolicy.clients"),
        prometheus=_peers(_get(raw, "prometheus", list(defaults.prometheus)), "spec.networkPolicy.prometheus"),
        gateway=_peers(_get(raw, "gateway", list(defaults.gateway)), "spec.networkPolicy.gateway"),
    )


def _check_adapters(spec: InferenceSpec) -> None:
    """What spec.adapters needs from the rest of the spec: a volume to find each adapter on, and no API key on the
    pods (the operator loads adapters through their admin endpoints and may not read Secrets)."""
    if not spec.adapters:
        return
    if spec.api_key_secret:
        raise SpecError("spec.adapters cannot be used with spec.apiKeySecretRef yet: the operator loads adapters "
                        "through the pods' /v1/load_lora_adapter, which would want the key, and it may not read "
                        "Secrets; serve the adapters behind the router's tenant keys instead "
                        "(spec.routing.router.tenantsSecretRef)")  # fmt: skip
    model, cache = spec.model, spec.model.cache
    for i, adapter in enumerate(spec.adapters):
        at = f"spec.adapters[{i}] ({adapter.name})"
        if adapter.name == model.served_name:
            raise SpecError(f"{at}: the name is the base model's served name (spec.model.servedName)")
        if adapter.hf_id and not (model.source == "huggingface" and cache.enabled
                                  and cache.volume == "persistentVolumeClaim"):  # fmt: skip
            raise SpecError(f"{at}: a Hugging Face adapter is downloaded onto the model cache, which needs "
                            "spec.model.source huggingface and spec.model.cache on a persistentVolumeClaim; give "
                            "source.path for an adapter already on the model's volume")  # fmt: skip
        if adapter.path and model.source != "pvc" and not cache.enabled:
            raise SpecError(f"{at}: source.path is a directory on the model's volume (spec.model.pvc, or the "
                            f"model cache), and model source {model.source} has none")  # fmt: skip


def parse_spec(raw: Mapping[str, Any] | None) -> InferenceSpec:
    """Parse an InferenceDeployment's `.spec` (defaulted by the API server or not: the same result)."""
    raw = with_defaults(raw)
    runtime_raw = _get(raw, "runtime", {})
    replicas = int(_get(raw, "replicas", InferenceSpec.replicas))
    if replicas < 0:
        raise SpecError(f"spec.replicas must not be negative; got {replicas}")
    spec = InferenceSpec(
        model=_parse_model(_get(raw, "model", {})),
        replicas=replicas,
        runtime=RuntimeSpec(
            image=_get(runtime_raw, "image", RuntimeSpec.image),
            rocm_image=_get(runtime_raw, "rocmImage", RuntimeSpec.rocm_image),
            image_pull_policy=_get(runtime_raw, "imagePullPolicy", RuntimeSpec.image_pull_policy),
            image_pull_secrets=tuple(s["name"] for s in _get(runtime_raw, "imagePullSecrets", ())),
            extra_args=tuple(str(a) for a in _get(runtime_raw, "extraArgs", ())),
            env=tuple(_get(runtime_raw, "env", ())),
            drain_timeout_s=int(_get(runtime_raw, "drainTimeoutSeconds", RuntimeSpec.drain_timeout_s)),
        ),
        engine=_parse_engine(_get(raw, "engine", {})),
        placement=_parse_placement(_get(raw, "placement", {})),
        resources=dict(_get(raw, "resources", {})),
        api_key_secret=_secret_ref(raw.get("apiKeySecretRef"), "apiKeySecretRef"),
        autoscaling=_parse_autoscaling(_get(raw, "autoscaling", {})),
        routing=_parse_routing(_get(raw, "routing", {})),
        slo=_fleet(parse_slo, raw.get("slo")),
        network_policy=_parse_network_policy(_get(raw, "networkPolicy", {})),
        adapters=_fleet(parse_adapters, raw.get("adapters")),
        parallelism=_parse_parallelism(raw.get("parallelism")),
    )
    _check_adapters(spec)
    if spec.autoscaling.mode == "optimizer" and spec.slo is None:
        raise SpecError("spec.autoscaling.mode optimizer needs spec.slo (ttftP90 and itlP90)")
    if spec.autoscaling.sleep_level and spec.api_key_secret:
        raise SpecError("spec.autoscaling.scaleToZero.sleepLevel cannot be used with spec.apiKeySecretRef yet: the "
                        "pods would want the key on /sleep and /wake_up, and the operator may not read Secrets; use "
                        "sleepLevel 0 (scale to zero replicas)")  # fmt: skip
    if spec.routing.tenants_secret and spec.routing.mode not in (None, "router"):
        raise SpecError(f"spec.routing.router.tenantsSecretRef needs routing mode router (only hpi-router checks "
                        f"tenants' keys); spec.routing.mode is {spec.routing.mode}")  # fmt: skip
    return spec
