"""Pick an attention backend by name (`--attention-backend`), importing only the one asked for."""

from __future__ import annotations

import torch

from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.attention.op import PagedAttentionOpBackend


def get_attention_backend(name: str, dtype: torch.dtype, device: torch.device | None = None) -> AttentionBackend:
    """`torch`: the `hpi::paged_attention` op (hpi_kernels' C++ kernel on CPU devices, else the reference
    TorchAttentionBackend); `triton`: hpi_kernels' CUDA kernels. `device=None` (shape-only models) builds
    no kernel."""
    if name == "torch":
        on_cpu = device is not None and torch.device(device).type == "cpu"
        return PagedAttentionOpBackend(dtype, prefer_cpu_kernel=on_cpu)
    if name == "triton":
        from hpi_runtime.attention.triton_backend import TritonAttentionBackend  # imports triton: only when asked

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
