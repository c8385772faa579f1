"""Batched LoRA for many adapters in one batch (punica's BGMV): each token times its own adapter's matrix.

`lora_bgmv` computes out[t] (+)= W[slot[t]] @ x[t] for every token t whose slot is not -1, reading W in place
through its strides (no gather of per-token weight copies). One program per (token, block of N outputs) walks
K in blocks: a matrix-vector product per token, the shape of a decode step. `lora_delta` is the whole LoRA
delta of one projection, shrink then expand into the layer's output: out[t] += B[s] @ (A[s] @ x[t]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hpi_kernels._validate import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_rank, interpreting


@triton.jit
def _lora_bgmv_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [S, N, K] (any strides): slot s's matrix
    out_ptr,  # [T, N]
    slot_ids_ptr,  # [T] int: each token's slot; -1 leaves its output row untouched
    N, K,
    stride_x_t, stride_x_k,
    stride_w_s, stride_w_n, stride_w_k,
    stride_o_t, stride_o_n,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    slot = tl.load(slot_ids_ptr + token).to(tl.int64)
    if slot < 0:
        return
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = rn < N
    w_slot = w_ptr + slot * stride_w_s
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + token * stride_x_t + k * stride_x_k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = tl.load(
            w_slot + rn[:, None] * stride_w_n + k[None, :] * stride_w_k,
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(w * x[None, :], axis=1)
    out_ptrs = out_ptr + token * stride_o_t + rn * stride_o_n
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def lora_bgmv(
    x: torch.Tensor,  # [T, K]
    weights: torch.Tensor,  # [S, N, K], any strides
    slot_ids: torch.Tensor,  # [T] int32/int64, -1: no adapter
    out: torch.Tensor,  # [T, N], x's dtype: written (or added to, with accumulate) where slot_ids >= 0
    accumulate: bool = False,
) -> torch.Tensor:
    """out[t] = W[slot_ids[t]] @ x[t] (+ out[t] with accumulate) for every t with slot_ids[t] >= 0."""
    check_rank("x", x, 2, "[T, K]")
    check_rank("weights", weights, 3, "[S, N, K]")
    check_rank("out", out, 2, "[T, N]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weights", weights, FLOAT_DTYPES)  # x's or another (--lora-dtype): both widened to fp32 sums
    if out.dtype != x.dtype:
        raise ValueError(f"out dtype {out.dtype} != x dtype {x.dtype}")
    check_dim("weights", weights, 2, x.shape[1], "x's K")
    check_dim("out", out, 0, x.shape[0], "x's T")
    check_dim("out", out, 1, weights.shape[1], "weights' N")
    check_dim("slot_ids", slot_ids, 0, x.shape[0], "x's T")
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_ids must be int32 or int64, got {slot_ids.dtype}")
    check_device(x=x, weights=weights, slot_ids=slot_ids, out=out)
    num_tokens, n = out.shape
    if num_tokens == 0 or n == 0:
        return out
    block_n = 32 if interpreting() else 64
    block_k = 32 if interpreting() else 128
    grid = (num_tokens, triton.cdiv(n, block_n))
    _lora_bgmv_kernel[grid](
        x, weights, out, slot_ids, n, x.shape[1], *x.stride(), *weights.stride(), *out.stride(),
        ACCUMULATE=accumulate, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


def lora_delta(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [S, W, K]: each slot's A (rank blocks stacked)
    b: torch.Tensor,  # [N, S, W]: each slot's B, scaling folded in (hpi_runtime's layout)
    slot_ids: torch.Tensor,  # [T], -1: no adapter
    out: torch.Tensor,  # [T, N]: the layer's output, the delta is added in place
) -> torch.Tensor:
    """out[t] += B[s] @ (A[s] @ x[t]), s = slot_ids[t] (tokens with -1 unchanged); returns out."""
    check_rank("b", b, 3, "[N, S, W]")
    shrunk = torch.zeros((x.shape[0], a.shape[1]), dtype=x.dtype, device=x.device)
    lora_bgmv(x, a, slot_ids, shrunk)
    return lora_bgmv(shrunk, b.permute(1, 0, 2), slot_ids, out, accumulate=True)
