"""Paged decode attention: one query token per request over its paged K/V, split-KV plus a reduction.

Each program owns one (request, kv head, split): it loads the whole GQA group of query heads (padded to a
power of two, at least 16 rows for tl.dot) so every K/V tile is read from memory once per kv head.
Long contexts with few requests are cut into `num_splits` token ranges whose partial results (normalised
output + log-sum-exp) a second kernel merges; with one split the first kernel writes the output directly.
With a sliding window the splits cover only the window's tokens: keys before it are never read (the KV
manager may point their blocks at a shared placeholder). Soft-capping (Gemma 2) caps scores before softmax.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hpi_kernels._validate import (
    check_device,
    check_dim,
    check_dtype,
    check_kv_cache,
    check_out,
    check_query_heads,
    check_rank,
    check_window_and_softcap,
    dot_in_fp32,
)

_LOG2E = 1.4426950408889634
_MIN_TOKENS_PER_SPLIT = 512
_MAX_SPLITS = 64
NO_WINDOW = 1 << 30  # the window the kernels get for global attention: longer than any context


@triton.jit
def softcap_log2(qk, softcap_log2e):
    """cap * tanh(score / cap) for scores in the log2 domain (score * log2 e, cap * log2 e), via the
    sigmoid: tanh(y) = 2 * sigmoid(2 y) - 1."""
    return softcap_log2e * (2.0 * tl.sigmoid(2.0 * qk / softcap_log2e) - 1.0)


@triton.jit
def _decode_kernel(
    query_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D] (written without SPLIT)
    partial_out_ptr,  # [B, Hq, num_splits, BLOCK_D] fp32 (written with SPLIT)
    partial_lse_ptr,  # [B, Hq, num_splits] fp32, log2 domain
    scale_log2e,
    sliding_window,  # a query attends its last `sliding_window` positions (NO_WINDOW: all)
    softcap_log2e,  # soft-cap times log2 e (used with SOFTCAP)
    num_splits,  # a runtime value, so that each split count does not compile a new kernel
    stride_q_b, stride_q_h, stride_q_d,
    stride_cache_block, stride_cache_tok, stride_cache_h, stride_cache_d,
    stride_bt_b, stride_bt_n,
    stride_out_b, stride_out_h, stride_out_d,
    group_size, head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partial results for the reduction
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + req)
    window_start = tl.maximum(context_len - sliding_window, 0)  # the first key the query sees
    tokens_per_split = tl.cdiv(tl.cdiv(context_len - window_start, num_splits), BLOCK_N) * BLOCK_N
    start = window_start + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group_size + g
    d_mask = d < head_dim
    q_mask = (g < group_size)[:, None] & d_mask[None, :]
    q = tl.load(
        query_ptr + req * stride_q_b + heads[:, None] * stride_q_h + d[None, :] * stride_q_d,
        mask=q_mask,
        other=0.0,
    )
    if UPCAST:  # the interpreter gets bf16 arithmetic wrong
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block_ids = tl.load(
            block_tables_ptr + req * stride_bt_b + (n // BLOCK_SIZE) * stride_bt_n, mask=n_mask, other=0
        ).to(tl.int64)
        # int64: block_id * stride_cache_block overflows int32 for large caches.
        tok_offsets = block_ids * stride_cache_block + (n % BLOCK_SIZE) * stride_cache_tok + kv_head * stride_cache_h
        kv_offsets = tok_offsets[:, None] + d[None, :] * stride_cache_d
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:  # a bf16 or fp8 cache widened to q's dtype for tl.dot (a no-op for a cache in q's dtype)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e  # [BLOCK_G, BLOCK_N]
        if SOFTCAP:
            qk = softcap_log2(qk, softcap_log2e)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    empty = l_i == 0.0  # only for an empty split or a zero context length
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if not SPLIT:
        tl.store(
            out_ptr + req * stride_out_b + heads[:, None] * stride_out_h + d[None, :] * stride_out_d,
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        row = (req * tl.num_programs(1) * group_size + heads) * num_splits + split  # [BLOCK_G]
        tl.store(partial_out_ptr + row[:, None] * BLOCK_D + d[None, :], out, mask=q_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(partial_lse_ptr + row, lse, mask=g < group_size)


@triton.jit
def _reduce_splits_kernel(
    partial_out_ptr,  # [B, Hq, num_splits, BLOCK_D] fp32
    partial_lse_ptr,  # [B, Hq, num_splits] fp32, log2 domain
    out_ptr,  # [B, Hq, D]
    stride_out_b, stride_out_h, stride_out_d,
    head_dim, num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    row = (req * tl.num_programs(1) + head) * num_splits
    lse = tl.load(partial_lse_ptr + row + s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    valid = lse != float("-inf")
    weights = tl.where(valid, tl.exp2(lse - tl.where(valid, lse_max, 0.0)), 0.0)
    partial = tl.load(
        partial_out_ptr + (row + s)[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0
    )
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + req * stride_out_b + head * stride_out_h + d * stride_out_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )


def choose_num_splits(num_programs: int, max_context_tokens: int, num_sms: int) -> int:
    """Splits so that about two waves of programs fill the GPU, each split covering >= 512 tokens."""
    if num_programs >= num_sms:
        return 1
    wanted = math.ceil(2 * num_sms / num_programs)
    by_length = max(1, max_context_tokens // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: splitting only adds work
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache per request (this step's included)
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D], written in place if given (any strides)
    sliding_window: int | None = None,  # attend only the last `sliding_window` positions
    logit_softcap: float | None = None,  # scores -> cap * tanh(scores / cap)
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one new query token per request over its paged K/V (already written)."""
    check_window_and_softcap(sliding_window, logit_softcap)
    check_kv_cache(k_cache, v_cache)
    check_rank("query", query, 3, "[batch, num_q_heads, head_dim]")
    group_size = check_query_heads(query, k_cache)
    check_rank("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_dim("block_tables", block_tables, 0, query.shape[0], "batch")
    check_rank("context_lens", context_lens, 1, "[batch]")
    check_dtype("context_lens", context_lens, (torch.int32,))
    check_dim("context_lens", context_lens, 0, query.shape[0], "batch")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    device = check_device(
        query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens
    )

    batch, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    out = check_out(out, query)
    if batch == 0:
        return out
    if num_splits is None:
        max_context_tokens = block_tables.shape[1] * block_size  # an upper bound that needs no host sync
        if sliding_window is not None:
            max_context_tokens = min(max_context_tokens, sliding_window)
        num_splits = choose_num_splits(batch * num_kv_heads, max_context_tokens, _num_sms(device))
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        partial_out = torch.empty((batch, num_q_heads, num_splits, block_d), dtype=torch.float32, device=device)
        partial_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=device)
    else:
        partial_out = partial_lse = out  # unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens.contiguous(), out, partial_out, partial_lse,
        scale * _LOG2E, sliding_window or NO_WINDOW, (logit_softcap or 1.0) * _LOG2E, num_splits,
        *query.stride(), *k_cache.stride(), *block_tables.stride(), *out.stride(),
        group_size, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        BLOCK_D=block_d,
        BLOCK_N=64,
        SPLIT=num_splits > 1,
        SOFTCAP=logit_softcap is not None,
        UPCAST=dot_in_fp32(query, k_cache),
    )
    if num_splits > 1:
        _reduce_splits_kernel[(batch, num_q_heads)](
            partial_out, partial_lse, out, *out.stride(), head_dim, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out
