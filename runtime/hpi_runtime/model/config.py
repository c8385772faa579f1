"""ModelConfig: what the runtime needs from a Hugging Face model directory's config files, validated once.

Reads config.json (architecture, shapes, RoPE in either the old `rope_theta`/`rope_scaling` keys or the
transformers-5 `rope_parameters` dict) and generation_config.json (EOS ids, default sampling settings).
Only architectures this runtime implements are accepted; models that need custom code are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpi_runtime.core import kv_budget

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# generation_config.json keys that map one-to-one onto SamplingParams fields
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


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

    @property
    def name(self) -> str:
        return self.model_dir.name

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers, unsharded."""
        return kv_budget.kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes)


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


def _read_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _check_architecture(raw: dict[str, Any], config_path: Path) -> str:
    if raw.get("auto_map"):
        raise ValueError(
            f"{config_path} declares auto_map (custom modelling code); this runtime never runs trust_remote_code models"
        )
    architectures = raw.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"{config_path} must name exactly one architecture, got {architectures}")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate `model_dir`/config.json (+ generation_config.json when present)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: not a Hugging Face model directory")
    raw = _read_json(config_path)
    architecture = _check_architecture(raw, config_path)
    generation_path = model_dir / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}

    num_heads = int(raw["num_attention_heads"])
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    sliding_window = raw.get("sliding_window")
    if is_qwen2 and not raw.get("use_sliding_window", False):
        sliding_window = None
    eos_token_ids = _as_id_set(generation.get("eos_token_id")) or _as_id_set(raw.get("eos_token_id"))
    return ModelConfig(
        model_dir=model_dir,
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=_read_rope(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always biases q/k/v and never o_proj; Llama's attention_bias covers all four.
        qkv_bias=True if is_qwen2 else attention_bias,
        o_proj_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        sliding_window=int(sliding_window) if sliding_window else None,
        eos_token_ids=eos_token_ids,
        bos_token_id=raw.get("bos_token_id"),
        sampling_defaults={k: generation[k] for k in _SAMPLING_DEFAULT_KEYS if generation.get(k) is not None},
    )
