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
    amx: torch.Tensor | None = None,  # lora_pack_amx(a, bt, part_cols): runs of one slot on AMX tiles where it has any
) -> torch.Tensor:  # [T, N]: out plus each token's delta (a new tensor), summed in fp32, rounded once
    """A copy of `out` through torch.ops.hpi_kernels.lora_add_, the in-place op that the LoRA hooks call directly
    on the projection's fresh output (torch.compile sees one opaque op and reinplaces it). With P parts, part p
    owns rows [p W/P, (p+1) W/P) of A and Bt and columns part_cols[p:p+2] of out; Bt outside those blocks is not
    read. Mismatched shapes or dtypes, parts that do not split W evenly, or a slot outside [-1, S) raise
    ValueError."""
    load_extension()
    result = out.clone(memory_format=torch.contiguous_format)
    torch.ops.hpi_kernels.lora_add_(result, x, a, bt, slots, part_cols or [0, bt.shape[2]], amx)
    return result


def lora_pack_amx(a: torch.Tensor, bt: torch.Tensor, part_cols: list[int] | None = None) -> torch.Tensor:
    """Every slot's panels for lora_add's AMX tiles: [S, size] bfloat16 where this CPU runs the packed bf16
    linears on AMX tiles (bf16 slots, in_features a multiple of 32), else [S, 0] (lora_add then keeps to its
    vector tiles). Runs of at least 16 consecutive tokens of one slot (a prefill chunk's) take them: the shrink
    and the expand as two GEMMs on the packed linear's tiles, the shrunk tokens rounded to bf16. Pack again after
    writing a slot's A or Bt (the runtime packs a slot as it loads it)."""
    load_extension()
    return torch.ops.hpi_kernels.lora_pack_amx(a, bt, part_cols or [0, bt.shape[2]])


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
