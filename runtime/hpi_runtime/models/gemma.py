"""Gemma 2 and Gemma 3 (text-only Gemma3ForCausalLM) on the shared decoder.

Everything that makes them Gemma is configuration that ModelConfig reads and the shared layers apply:
GELU-tanh gated MLP, RMSNorm scaling by (1 + weight) in fp32, embeddings times sqrt(hidden_size), norms
before and after both attention and MLP, attention scaled by query_pre_attn_scalar ** -0.5, sliding-window
layers alternating with global ones (`ModelConfig.layer_sliding_windows`), Gemma 2's attention and
final-logit soft-capping, Gemma 3's per-head q/k norms and its local layers' own RoPE base frequency.
The checkpoint layout is Llama's.
"""

from __future__ import annotations

from typing import Any

from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.family import FamilyRules, LayerTypes


class GemmaRules(FamilyRules):
    """What Gemma 2 and 3 share; one global layer in every `global_every` layers."""

    __slots__ = ()
    ties_word_embeddings = True

    def global_every(self, raw: dict[str, Any]) -> int:
        raise NotImplementedError

    def layer_types(self, raw: dict[str, Any], num_layers: int) -> LayerTypes | None:
        pattern = self.global_every(raw)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]

    def fields(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        if raw.get("use_bidirectional_attention"):
            raise ValueError("bidirectional (embedding) Gemma models are not generative; not supported")
        return {
            "norm_unit_offset": True,
            "scale_embeddings": True,
            "sandwich_norms": True,
            "attention_scale": float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            "final_logit_softcap": raw.get("final_logit_softcapping"),
        }


class Gemma2Rules(GemmaRules):
    """Local and global layers alternate from layer 0; attention logits are soft-capped."""

    __slots__ = ()

    def global_every(self, raw: dict[str, Any]) -> int:
        return 2

    def fields(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        return {**super().fields(raw, head_dim), "attn_logit_softcap": raw.get("attn_logit_softcapping")}


class Gemma3Rules(GemmaRules):
    """Per-head q/k norms; local layers with their own RoPE base (10,000; the global one defaults to 1e6).
    Gemma 3's config may carry attn_logit_softcapping, but transformers never applies it there."""

    __slots__ = ()
    default_rope_theta = 1_000_000.0

    def global_every(self, raw: dict[str, Any]) -> int:
        return int(raw.get("sliding_window_pattern", 6))

    def sliding_rope_params(self) -> dict[str, Any] | None:
        return {"rope_type": "default", "rope_theta": 10000.0}

    def fields(self, raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
        return {**super().fields(raw, head_dim), "qk_norm": True}


class GemmaForCausalLM(DecoderForCausalLM):
    """What the Gemma 2 and Gemma 3 text models share: Llama's checkpoint layout."""


class Gemma2ForCausalLM(GemmaForCausalLM):
    config_rules = Gemma2Rules()


class Gemma3ForCausalLM(GemmaForCausalLM):
    config_rules = Gemma3Rules()
