"""Qwen2 (and Qwen2.5): Llama's decoder and checkpoint layout with a bias on q/k/v (never on o_proj) and
Qwen's sliding-window rule, which Qwen3 and the Qwen MoE families share.
"""

from __future__ import annotations

from typing import Any

from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.family import FamilyRules, LayerTypes


class QwenRules(FamilyRules):
    """Qwen's window applies only with `use_sliding_window`, from layer `max_window_layers` on."""

    __slots__ = ()

    def sliding_window(self, raw: dict[str, Any]) -> Any:
        return raw.get("sliding_window") if raw.get("use_sliding_window", False) else None

    def layer_types(self, raw: dict[str, Any], num_layers: int) -> LayerTypes | None:
        first = int(raw.get("max_window_layers", num_layers))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]


class Qwen2Rules(QwenRules):
    __slots__ = ()

    def fields(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        return {"qkv_bias": True, "o_proj_bias": False}  # always, whatever `attention_bias` says


class Qwen2ForCausalLM(DecoderForCausalLM):
    config_rules = Qwen2Rules()
