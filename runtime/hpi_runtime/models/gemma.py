"""Gemma 2 and Gemma 3 (text-only Gemma3ForCausalLM) on the shared decoder.

Everything that makes them Gemma is configuration that ModelConfig reads and the shared layers apply:
GELU-tanh gated MLP, RMSNorm scaling by (1 + weight) in fp32, embeddings times sqrt(hidden_size), norms
before and after both attention and MLP, attention scaled by query_pre_attn_scalar ** -0.5, sliding-window
layers alternating with global ones (`ModelConfig.layer_sliding_windows`), Gemma 2's attention and
final-logit soft-capping, Gemma 3's per-head q/k norms and its local layers' own RoPE base frequency.
The checkpoint layout is Llama's.
"""

from __future__ import annotations

from hpi_runtime.models.decoder import DecoderForCausalLM


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma 2 and Gemma 3 text models."""
