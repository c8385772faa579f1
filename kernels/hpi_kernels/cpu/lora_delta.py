"""Batched LoRA on CPU (lora_delta.cpp): out[t] += B[s] (A[s] x[t]) for each token's slot s, one call per
projection, the tokens of one slot taken a few at a time so each slot's matrices stream once per tile."""

from __future__ import annotations

import torch

from hpi_kernels.cpu._extension import load_extension


def lora_add(
    x: torch.Tensor,  # [T, K] float32 or bfloat16
    a: torch.Tensor,  # [S, W, K]: slot s's A (W = parts x max_rank)
    bt: torch.Tensor,  # [S, W, N]: slot s's B, transposed
    slots: torch.Tensor,  # [T] int64: each token's slot, -1 for none
    out: torch.Tensor,  # [T, N]: the base projection's output
) -> torch.Tensor:  # [T, N]: out plus each token's delta (a new tensor), summed in fp32, rounded once
    """A copy of `out` through torch.ops.hpi_kernels.lora_add_, the in-place op that the LoRA hooks call directly
    on the projection's fresh output (torch.compile sees one opaque op and reinplaces it). Mismatched shapes or
    dtypes, or a slot outside [-1, S), raise ValueError."""
    load_extension()
    result = out.clone(memory_format=torch.contiguous_format)
    torch.ops.hpi_kernels.lora_add_(result, x, a, bt, slots)
    return result


def lora_add_ref(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor, out: torch.Tensor):
    """Plain PyTorch, in the inputs' dtype (pass float64 for a reference)."""
    result = out.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            result[t] += (a[s] @ x[t]) @ bt[s]
    return result
