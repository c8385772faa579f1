"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, SmolLM): the shared decoder with Llama's checkpoint layout.

Mistral and Qwen2 differ from Llama only in config values (biases, sliding window) that ModelConfig reads.
The architecture registry (config.json's `architectures` -> model class) is models/registry.py.
"""

from __future__ import annotations

from hpi_runtime.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Separate q/k/v and gate/up projections in the checkpoint, merged here (DecoderForCausalLM's default)."""
