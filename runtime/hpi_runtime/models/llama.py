"""The Llama family (Llama 2/3/3.1, Mistral, SmolLM): the shared decoder with Llama's checkpoint layout.

Mistral differs from Llama only in config values (a sliding window) that Llama's rules already read. The
architecture registry (config.json's `architectures` -> model class) is models/registry.py.
"""

from __future__ import annotations

from hpi_runtime.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Separate q/k/v and gate/up projections in the checkpoint, merged here (DecoderForCausalLM's default);
    config.json read by the base FamilyRules (Llama's)."""
