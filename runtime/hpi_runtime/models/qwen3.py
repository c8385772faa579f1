"""Qwen3 (dense): Llama's layout plus an RMSNorm over each q and k head before RoPE, no qkv bias, and Qwen's
sliding-window rule (qwen2.py).

`Qwen3Attention` is the attention Qwen3-MoE shares (a MoE family builds on `Qwen3ForCausalLM` and overrides
`make_mlp`). The q/k norms themselves live in DecoderAttention, switched on by `ModelConfig.qk_norm`.
"""

from __future__ import annotations

from typing import Any

from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.models.config import ModelConfig
from hpi_runtime.models.decoder import DecoderAttention, DecoderForCausalLM
from hpi_runtime.models.parallel import TensorParallel
from hpi_runtime.models.qwen2 import QwenRules


class Qwen3Rules(QwenRules):
    __slots__ = ()

    def fields(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        return {"qk_norm": True}


class Qwen3Attention(DecoderAttention):
    """DecoderAttention with per-head q/k RMSNorm (checkpoint names `self_attn.q_norm`, `self_attn.k_norm`)."""

    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, tp: TensorParallel) -> None:
        if not config.qk_norm:
            raise ValueError(f"{config.architecture}: Qwen3 attention needs ModelConfig.qk_norm")
        super().__init__(config, layer, backend, tp)


class Qwen3ForCausalLM(DecoderForCausalLM):
    config_rules = Qwen3Rules()

    def make_attention(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, tp: TensorParallel
    ) -> Qwen3Attention:
        return Qwen3Attention(config, layer, backend, tp)
