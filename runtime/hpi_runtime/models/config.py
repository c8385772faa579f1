"""ModelConfig: what the runtime needs from a Hugging Face model directory's config files, validated once.

Reads config.json (architecture, shapes, RoPE in either the old `rope_theta`/`rope_scaling` keys or the
transformers-5 `rope_parameters` dict) and generation_config.json (EOS ids, default sampling settings).
Only architectures this runtime implements (models/registry.py) are accepted; models that need custom code
are refused.

Families differ only in fields of ModelConfig (biases, q/k norms, Gemma's norm offset and soft-capping, per-layer
sliding windows and RoPE), which the shared decoder in models/decoder.py reads; each family's module says how
its config.json sets them (its `config_rules`, family.py), and this module asks those rules, never an
architecture name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpi_contracts import kv_cache
from hpi_runtime.models import registry

if TYPE_CHECKING:
    from hpi_runtime.models.family import FamilyRules

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")  # transformers' ACT2FN names
# generation_config.json keys that map one-to-one onto SamplingParams fields
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and longrope
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original length
    long_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors beyond it
    attention_factor: float = 1.0  # longrope: multiplies cos and sin
    # longrope: which factors this engine uses, for every position (see ModelConfig.for_max_model_len)
    use_long_factor: bool = False
    partial_rotary_factor: float = 1.0  # the fraction of head_dim that is rotated (Phi-4-mini: 0.75)
    # M-RoPE (Qwen2-VL): rotary frequency pairs per position axis (temporal, height, width), summing to
    # rotary_dim // 2; positions are then [3, num_tokens]. Empty: one position per token.
    mrope_section: tuple[int, ...] = ()


@dataclass(frozen=True)
class MoEConfig:
    """A Mixture-of-Experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE; see models/moe.py)."""

    num_experts: int
    num_experts_per_tok: int  # top-k
    expert_intermediate_size: int  # of each routed expert
    norm_topk_prob: bool  # renormalise the k routing weights to sum to 1 (Mixtral always does)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert; 0: none
    dense_layer_ids: frozenset[int] = frozenset()  # layers with the dense MLP instead (Qwen's mlp_only_layers)


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language model's image side: its placeholder token, the encoder's patching, and the vision
    tower's own config.json section (built by the family's model class)."""

    image_token_id: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int  # patches merged per side into one embedding row
    vision_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    torch_dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"
    sliding_window: int | None
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    # SamplingParams field -> default from generation_config.json (only keys it sets)
    sampling_defaults: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # Per-family choices; the defaults are Llama's.
    hidden_act: str = "silu"  # of the gated MLP, one of SUPPORTED_ACTIVATIONS
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight), in fp32
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and after the MLP, and one before the MLP
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before softmax
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    # For layer i: how many most recent tokens (the query's own included) a query may attend, None = all.
    # Empty when built by hand: then every layer gets `sliding_window`.
    layer_sliding_windows: tuple[int | None, ...] = ()
    sliding_rope: RopeConfig | None = None  # RoPE of the sliding-window layers when it differs (Gemma 3)
    moe: MoEConfig | None = None  # None: every layer has the dense MLP
    vision: VisionConfig | None = None  # None: a text-only model

    def __post_init__(self) -> None:
        if not self.layer_sliding_windows:
            object.__setattr__(self, "layer_sliding_windows", (self.sliding_window,) * self.num_layers)
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_sliding_windows)} layer sliding windows for {self.num_layers} layers")

    @property
    def name(self) -> str:
        return self.model_dir.name

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE of layer `layer`: Gemma 3's local layers have their own base frequency."""
        if self.sliding_rope is not None and self.layer_sliding_windows[layer] is not None:
            return self.sliding_rope
        return self.rope

    def for_max_model_len(self, max_model_len: int) -> ModelConfig:
        """This config for an engine serving up to `max_model_len` tokens. LongRoPE picks its long factors for
        every position when the engine may cross the original context length, as vLLM does: switching
        factors mid-request (transformers, per forward call) would leave the cached keys rotated the other way.
        """
        rope = self.rope
        if rope.rope_type != "longrope":
            return self
        use_long = max_model_len > rope.original_max_position_embeddings
        return replace(self, rope=replace(rope, use_long_factor=use_long))

    @property
    def num_layer_parameters(self) -> int:
        """The parameters one token runs through in an average decoder layer: the attention projections and the
        dense MLP or the router, the top-k experts and the shared expert (what a layer costs per token; the
        pipeline split weighs the LM head against it)."""
        attention = 2 * self.hidden_size * (self.num_heads + self.num_kv_heads) * self.head_dim
        dense = 3 * self.hidden_size * self.intermediate_size
        if self.moe is None:
            return attention + dense
        moe = self.moe
        experts_run = moe.num_experts_per_tok * moe.expert_intermediate_size + moe.shared_expert_intermediate_size
        routed = self.hidden_size * moe.num_experts + 3 * self.hidden_size * experts_run
        num_dense = len(moe.dense_layer_ids)
        return attention + (num_dense * dense + (self.num_layers - num_dense) * routed) // self.num_layers

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers, unsharded."""
        return kv_cache.kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _as_id_set(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset((value,))
    return frozenset(int(v) for v in value)


def _rope_params(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global RoPE parameters, sliding-window layers' own or None) in the transformers-5 flat form, from
    `rope_parameters` (flat, or per layer type as Gemma 3 saves it) and/or the older keys."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    if "full_attention" in params or "sliding_attention" in params:  # per layer type
        full = dict(params.get("full_attention") or {})
        sliding = params.get("sliding_attention")
        return {**scaling, **full}, dict(sliding) if sliding is not None else None
    params = {**scaling, **params}
    if raw.get("rope_local_base_freq") is not None:  # Gemma 3 before transformers 5
        return params, {"rope_type": "default", "rope_theta": raw["rope_local_base_freq"]}
    return params, None


def _read_rope(params: dict[str, Any], raw: dict[str, Any], rules: FamilyRules, default_theta: float) -> RopeConfig:
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = rules.rope_type(params.get("rope_type", params.get("type", "default")))
    if rope_type == "su":  # Phi-3's first checkpoints' name of LongRoPE
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    default_original = 8192 if rope_type == "llama3" else raw.get("max_position_embeddings", 2048)
    original = int(
        params.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or default_original
    )
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if rope_type != "longrope":
        return RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            partial_rotary_factor=partial,
            mrope_section=tuple(int(n) for n in params.get("mrope_section") or ()),
        )
    # LongRoPE, as transformers' _compute_longrope_parameters: without an explicit factor, the ratio of the
    # extended to the original context; the attention factor from the paper unless given.
    factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short_factor, long_factor = params.get("short_factor"), params.get("long_factor")
    if not short_factor or not long_factor:
        raise ValueError("longrope RoPE scaling needs both short_factor and long_factor")
    return RopeConfig(
        theta=float(theta),
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(f) for f in short_factor),
        long_factor=tuple(float(f) for f in long_factor),
        attention_factor=float(attention_factor),
        partial_rotary_factor=partial,
    )


def _layer_sliding_windows(
    rules: FamilyRules, raw: dict[str, Any], num_layers: int, sliding_window: int | None
) -> tuple[int | None, ...]:
    """Which layers use the window, from `layer_types` when config.json has it (transformers 5 writes it),
    else the family's rule as transformers applies it."""
    if sliding_window is None:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None:
        layer_types = rules.layer_types(raw, num_layers)
    if layer_types is None:
        return (sliding_window,) * num_layers
    if len(layer_types) != num_layers or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must give 'sliding_attention' or 'full_attention' for each of the "
                         f"{num_layers} layers, got {layer_types}")  # fmt: skip
    return tuple(sliding_window if t == "sliding_attention" else None for t in layer_types)


def _family_fields(rules: FamilyRules, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields in which a family differs from Llama: the common reading, then the family's."""
    attention_bias = bool(raw.get("attention_bias", False))
    fields: dict[str, Any] = {
        "qkv_bias": attention_bias,
        "o_proj_bias": attention_bias,
        "hidden_act": raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
        **rules.fields(raw, head_dim),
    }
    if fields["hidden_act"] not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported activation {fields['hidden_act']!r}; supported: "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)}")  # fmt: skip
    return fields


def _check_architecture(raw: dict[str, Any], config_path: Path) -> str:
    if raw.get("auto_map"):
        raise ValueError(
            f"{config_path} declares auto_map (custom modelling code); this runtime never runs trust_remote_code models"
        )
    architectures = raw.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"{config_path} must name exactly one architecture, got {architectures}")
    return architectures[0]  # the registry refuses one it does not implement (family_rules)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate `model_dir`/config.json (+ generation_config.json when present)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: not a Hugging Face model directory")
    raw = _read_json(config_path)
    architecture = _check_architecture(raw, config_path)
    if isinstance(raw.get("text_config"), dict):  # a vision-language model: its decoder's settings sit there
        raw = {**raw, **raw["text_config"]}
    rules = registry.family_rules(architecture)
    generation_path = model_dir / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}

    num_heads = int(raw["num_attention_heads"])
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    num_layers = int(raw["num_hidden_layers"])
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // num_heads)
    sliding_window = rules.sliding_window(raw)
    sliding_window = int(sliding_window) if sliding_window else None
    rope_params, sliding_rope_params = _rope_params(raw)
    if sliding_rope_params is None:
        sliding_rope_params = rules.sliding_rope_params()
    eos_token_ids = _as_id_set(generation.get("eos_token_id")) or _as_id_set(raw.get("eos_token_id"))
    return ModelConfig(
        model_dir=model_dir,
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=_read_rope(rope_params, raw, rules, rules.default_rope_theta),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", rules.ties_word_embeddings)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        sliding_window=sliding_window,
        eos_token_ids=eos_token_ids,
        bos_token_id=raw.get("bos_token_id"),
        sampling_defaults={k: generation[k] for k in _SAMPLING_DEFAULT_KEYS if generation.get(k) is not None},
        layer_sliding_windows=_layer_sliding_windows(rules, raw, num_layers, sliding_window),
        sliding_rope=_read_rope(sliding_rope_params, raw, rules, 10000.0) if sliding_rope_params is not None else None,
        **_family_fields(rules, raw, head_dim),
        moe=rules.moe(raw, num_layers),
        vision=rules.vision(raw),
    )

