"""The per-layer attention module: a layer's cache tensors, scale, window and soft-cap, run by a backend."""

from __future__ import annotations

import torch
from torch import nn

from hpi_runtime.attention.backend import AttentionBackend


class Attention(nn.Module):
    """One layer's paged attention; the runner binds the layer's cache tensors after allocating them.

    `scale` defaults to head_dim ** -0.5; `sliding_window` (None = global) and `logit_softcap` (None = off)
    are this layer's (see the module docstring)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        scale: float | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.backend = backend
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, num_kv_heads, head_dim] once bound
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: object) -> torch.Tensor:
        return self.backend.forward(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            metadata,
            self.scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )
