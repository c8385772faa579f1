"""Fused Mixture-of-Experts: every expert's SiLU-gated MLP over its routed tokens, as grouped GEMMs.

vLLM's fused_moe shape: the (token, slot) pairs that top-k routing produced are sorted by expert and each
expert's run is padded to a multiple of BLOCK_M (`moe_align_block_size`), so every row block of the sorted
list belongs to one expert. One kernel launch then multiplies every block by its expert's weight, reading
the token rows in place through the sorted ids (no gather copy): first x @ W13[e].T into [T * top_k, 2I],
then, after SiLU(gate) * up, act @ W2[e].T scaled by the routing weight into [T * top_k, H], summed over
the k slots. The sorted list is sized for the worst case (every expert's run one row short of a block),
so aligning needs no host synchronisation; blocks past the end carry expert -1 and return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hpi_kernels._validate import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_rank, interpreting


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [num_a_rows, K]: tokens (first GEMM, TOP_K = top_k) or token slots (second GEMM, TOP_K = 1)
    b_ptr,  # [E, N, K]: the experts' weights
    c_ptr,  # [num_slots, N]: one row per (token, slot) pair
    topk_weights_ptr,  # [num_slots] fp32 routing weights, read when MUL_ROUTED_WEIGHT
    sorted_ids_ptr,  # [num_padded] int32: slot ids grouped by expert; num_slots marks padding
    expert_ids_ptr,  # [num_padded // BLOCK_M] int32: each row block's expert, -1 past the end
    N, K, num_slots,
    stride_a_m, stride_a_k,
    stride_b_e, stride_b_n, stride_b_k,
    stride_c_m, stride_c_n,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = slots < num_slots
    a_rows = slots // TOP_K
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = rn < N
    b_expert = b_ptr + expert * stride_b_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a_m + k[None, :] * stride_a_k,
            mask=row_mask[:, None] & k_mask[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            b_expert + rn[None, :] * stride_b_n + k[:, None] * stride_b_k,
            mask=k_mask[:, None] & n_mask[None, :], other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if UPCAST:  # the interpreter gets bf16 arithmetic wrong; fp32 wants its ieee dot
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision="ieee")
    if MUL_ROUTED_WEIGHT:
        weights = tl.load(topk_weights_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * weights[:, None]
    tl.store(
        c_ptr + slots[:, None] * stride_c_m + rn[None, :] * stride_c_n,
        acc.to(c_ptr.dtype.element_ty),
        mask=row_mask[:, None] & n_mask[None, :],
    )


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, top_k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # (sorted_ids [num_padded] int32, expert_ids [num_padded // block_m] int32)
    """The (token, slot) ids t * top_k + j grouped by expert, each expert's run padded to a multiple of
    `block_m` with the id T * top_k; `expert_ids[b]` is row block b's expert (-1 for the unused tail)."""
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    num_padded = num_slots + num_experts * (block_m - 1)
    num_padded = -(-num_padded // block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    run_starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    experts_in_order = flat[order]
    rank_in_run = torch.arange(num_slots, device=flat.device) - (torch.cumsum(counts, 0) - counts)[experts_in_order]
    sorted_ids = torch.full((num_padded,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_ids[run_starts[experts_in_order] + rank_in_run] = order.to(torch.int32)
    blocks_per_expert = padded // block_m
    expert_ids = torch.full((num_padded // block_m,), -1, dtype=torch.int32, device=flat.device)
    used = torch.repeat_interleave(torch.arange(num_experts, dtype=torch.int32, device=flat.device), blocks_per_expert)
    expert_ids[: used.numel()] = used
    return sorted_ids, expert_ids


def _grouped_gemm(
    a: torch.Tensor,  # [num_a_rows, K]
    b: torch.Tensor,  # [E, N, K]
    out: torch.Tensor,  # [num_slots, N]
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # (topk_weights [num_slots], sorted_ids, expert_ids)
    top_k: int,  # a's rows per slot id: slot // top_k
    block_m: int,
) -> None:
    topk_weights, sorted_ids, expert_ids = routing
    n, k = b.shape[1], b.shape[2]
    block_n = 64 if n >= 64 else 32
    block_k = 32 if a.dtype == torch.float32 else 64
    grid = (triton.cdiv(n, block_n), expert_ids.numel())
    _fused_moe_kernel[grid](
        a, b, out, topk_weights, sorted_ids, expert_ids,
        n, k, out.shape[0],
        *a.stride(), *b.stride(), *out.stride(),
        TOP_K=top_k,
        MUL_ROUTED_WEIGHT=top_k == 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=interpreting() or a.dtype == torch.float32,
        num_warps=4,
    )


def fused_experts(
    hidden: torch.Tensor,  # [T, H] fp16/bf16/fp32
    w13: torch.Tensor,  # [E, 2 * I, H]: gate rows [0, I), up rows [I, 2I)
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k] float routing weights
    topk_ids: torch.Tensor,  # [T, top_k] int experts
) -> torch.Tensor:  # [T, H], hidden.dtype
    """sum_j topk_weights[t, j] * W2[e] @ (SiLU(W1[e] @ x_t) * W3[e] @ x_t), e = topk_ids[t, j]."""
    check_rank("hidden", hidden, 2, "[T, H]")
    check_dtype("hidden", hidden, FLOAT_DTYPES)
    check_rank("w13", w13, 3, "[E, 2 * I, H]")
    check_rank("w2", w2, 3, "[E, H, I]")
    num_experts, two_i, h = w13.shape
    check_dim("hidden", hidden, 1, h, "w13's H")
    check_dim("w2", w2, 0, num_experts, "the number of experts")
    check_dim("w2", w2, 1, h, "H")
    check_dim("w2", w2, 2, two_i // 2, "half of w13's rows")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != hidden.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != hidden dtype {hidden.dtype}")
    check_rank("topk_ids", topk_ids, 2, "[T, top_k]")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} differ")
    check_dim("topk_ids", topk_ids, 0, hidden.shape[0], "T")
    device = check_device(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return hidden.new_empty(hidden.shape)
    block_m = 16 if num_tokens * top_k <= 32 * num_experts else 64
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts, block_m)
    routing = (topk_weights.float().contiguous().flatten(), sorted_ids, expert_ids)
    gate_up = torch.empty((num_tokens * top_k, two_i), dtype=hidden.dtype, device=device)
    _grouped_gemm(hidden, w13, gate_up, routing, top_k, block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up  # [T * top_k, I]
    out = torch.empty((num_tokens * top_k, h), dtype=hidden.dtype, device=device)
    _grouped_gemm(act, w2, out, routing, 1, block_m)
    return out.view(num_tokens, top_k, h).sum(dim=1)
