"""The attention backend interface: what every paged-attention implementation offers the model.

A backend turns the common metadata (metadata.py) into its own (`build_metadata`, once per step) and then
runs every layer with it (`forward`). Per layer, `forward` also gets the layer's sliding window (a query at
position p attends keys at positions p - window + 1 .. p; None = all) and attention-logit soft-cap
(scores -> cap * tanh(scores / cap) before the mask and softmax; None = off). Every backend skips keys
outside the window without reading them: the KV manager may point blocks wholly outside every layer's
window at a shared placeholder.

Backends (factory.py picks one by name): `torch` is the `hpi::paged_attention` op (op.py: the C++ CPU
kernel, falling back to TorchAttentionBackend in torch_backend.py, the reference), the one a compiled model
step can contain; `triton` is the CUDA path (triton_backend.py), run eagerly or, for decode steps, replayed from
CUDA graphs (`supports_cuda_graphs`: worker/cuda_graphs.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from hpi_runtime.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, common: AttentionMetadata) -> object:
        """Once per step: precompute whatever every layer reuses (the backend's own metadata type; for a
        backend with `supports_compile`, tensors only)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: object,  # what build_metadata returned
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v into their slots, then attend each query over its request's cached context (within
        `sliding_window` most recent positions when set).

        q, k and v may be strided views (slices of the fused qkv projection); the caches are contiguous.
        """
        ...

