"""Batched LoRA on CPU (lora_delta.cpp): out[t] += B[s] (A[s] x[t]) for each token's slot s, one call per
projection, the tokens of one slot taken a few at a time so each slot's matrices stream once per tile."""

from __future__ import annotations

import itertools

import torch

from hpi_kernels.cpu._extension import load_extension


def lora_add(
    x: torch.Tensor,  # [T, K] float32 or bfloat16
    a: torch.Tensor,  # [S, W, K]: slot s's A (W = parts x max_rank)
    bt: torch.Tensor,  # [S, W, N]: slot s's B, transposed
    slots: torch.Tensor,  # [T] int64: each token's slot, -1 for none
    out: torch.Tensor,  # [T, N]: the base projection's output
    part_cols: list[int] | None = None,  # a fused projection's parts: column offsets from 0 to N; None: one part
) -> torch.Tensor:  # [T, N]: out plus each token's delta (a new tensor), summed in fp32, rounded once
    """A copy of `out` through torch.ops.hpi_kernels.lora_add_, the in-place op that the LoRA hooks call directly
    on the projection's fresh output (torch.compile sees one opaque op and reinplaces it). With P parts, part p
    owns rows [p W/P, (p+1) W/P) of A and Bt and columns part_cols[p:p+2] of out; Bt outside those blocks is not
    read. Mismatched shapes or dtypes, parts that do not split W evenly, or a slot outside [-1, S) raise
    ValueError."""
    load_extension()
    result = out.clone(memory_format=torch.contiguous_format)
    torch.ops.hpi_kernels.lora_add_(result, x, a, bt, slots, part_cols or [0, bt.shape[2]])
    return result


def lora_add_ref(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                 part_cols: list[int] | None = None):  # fmt: skip
    """Plain PyTorch, in the inputs' dtype (pass float64 for a reference)."""
    part_cols = part_cols or [0, bt.shape[2]]
    width = bt.shape[1] // (len(part_cols) - 1)
    blocks = torch.zeros_like(bt)  # Bt's part blocks alone
    for p, (c0, c1) in enumerate(itertools.pairwise(part_cols)):
        blocks[:, p * width : (p + 1) * width, c0:c1] = bt[:, p * width : (p + 1) * width, c0:c1]
    result = out.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            result[t] += (a[s] @ x[t]) @ blocks[s]
    return result
