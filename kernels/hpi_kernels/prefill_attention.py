"""Paged prefill/extend attention: variable-length query chunks attending causally to their paged K/V.

One launch covers a mixed batch (new prompts, chunked-prefill continuations, prefix-cache hits, decode
tokens): request b's queries are rows query_start_loc[b]:query_start_loc[b + 1] and sit at positions
context_lens[b] - q_len_b .. context_lens[b] - 1. Their own K/V are already in the cache, so every key,
cached prefix or new, is read through the block table. Each program owns BLOCK_M query rows of one query
head and runs a flash-attention loop up to its last row's position, from its first row's window start
on with a sliding window (keys before it are never read), soft-capping scores when asked (Gemma 2).
"""

from __future__ import annotations

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
from hpi_kernels.paged_attention import NO_WINDOW, softcap_log2

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    query_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D]
    scale_log2e,
    sliding_window,  # a query attends its last `sliding_window` positions (NO_WINDOW: all)
    softcap_log2e,  # soft-cap times log2 e (used with SOFTCAP)
    stride_q_t, stride_q_h, stride_q_d,
    stride_cache_block, stride_cache_tok, stride_cache_h, stride_cache_d,
    stride_bt_b, stride_bt_n,
    stride_out_t, stride_out_h, stride_out_d,
    group_size, head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int64) - q_start
    if tile * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + req)
        prefix_len = context_len - q_len
        kv_head = head // group_size

        i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        row_mask = i < q_len
        d_mask = d < head_dim
        q_mask = row_mask[:, None] & d_mask[None, :]
        q_positions = prefix_len + i  # padded rows land past the context: harmless, never stored
        q = tl.load(
            query_ptr + (q_start + i)[:, None] * stride_q_t + head * stride_q_h + d[None, :] * stride_q_d,
            mask=q_mask,
            other=0.0,
        )
        if UPCAST:  # the interpreter gets bf16 arithmetic wrong
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        kv_end = tl.minimum(context_len, prefix_len + (tile + 1) * BLOCK_M)  # causal: last row's position + 1
        kv_start = tl.maximum(prefix_len + tile * BLOCK_M - sliding_window + 1, 0)  # the first row's window
        for tile_start in range(kv_start, kv_end, BLOCK_N):
            n = tile_start + tl.arange(0, BLOCK_N)
            n_mask = n < kv_end
            block_ids = tl.load(
                block_tables_ptr + req * stride_bt_b + (n // BLOCK_SIZE) * stride_bt_n, mask=n_mask, other=0
            ).to(tl.int64)
            # int64: block_id * stride_cache_block overflows int32 for large caches.
            tok_offsets = (
                block_ids * stride_cache_block + (n % BLOCK_SIZE) * stride_cache_tok + kv_head * stride_cache_h
            )
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
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e  # [BLOCK_M, BLOCK_N]
            if SOFTCAP:
                qk = softcap_log2(qk, softcap_log2e)
            visible = (n[None, :] <= q_positions[:, None]) & (n[None, :] > q_positions[:, None] - sliding_window)
            qk = tl.where(visible & n_mask[None, :], qk, float("-inf"))
            # A row that has seen no visible key yet (one before its window, or a pad row) keeps m = -inf:
            # subtract 0 instead, so that exp2 gives 0 rather than NaN.
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + (q_start + i)[:, None] * stride_out_t + head * stride_out_h + d[None, :] * stride_out_d,
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D], requests' query chunks concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, cumulative query lengths starting at 0
    context_lens: torch.Tensor,  # [B] int32, total tokens per request including this step's new ones
    scale: float,
    max_query_len: int | None = None,  # host-side max q_len if the caller has it (saves a device sync)
    out: torch.Tensor | None = None,  # [T, Hq, D], written in place if given (any strides)
    sliding_window: int | None = None,  # a query attends only its last `sliding_window` positions
    logit_softcap: float | None = None,  # scores -> cap * tanh(scores / cap)
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each request's new query tokens over its cached prefix plus themselves."""
    check_window_and_softcap(sliding_window, logit_softcap)
    check_kv_cache(k_cache, v_cache)
    check_rank("query", query, 3, "[num_tokens, num_q_heads, head_dim]")
    group_size = check_query_heads(query, k_cache)
    check_rank("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_rank("context_lens", context_lens, 1, "[batch]")
    check_dtype("context_lens", context_lens, (torch.int32,))
    batch = context_lens.shape[0]
    check_dim("block_tables", block_tables, 0, batch, "batch")
    check_rank("query_start_loc", query_start_loc, 1, "[batch + 1]")
    check_dtype("query_start_loc", query_start_loc, (torch.int32,))
    check_dim("query_start_loc", query_start_loc, 0, batch + 1, "batch + 1")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    check_device(
        query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        query_start_loc=query_start_loc, context_lens=context_lens,
    )

    num_tokens, num_q_heads, head_dim = query.shape
    out = check_out(out, query)
    if num_tokens == 0 or batch == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # a device sync
    if max_query_len <= 0:
        return out
    block_m = 16 if max_query_len <= 16 else 64
    grid = (triton.cdiv(max_query_len, block_m), batch, num_q_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc.contiguous(), context_lens.contiguous(), out,
        scale * _LOG2E, sliding_window or NO_WINDOW, (logit_softcap or 1.0) * _LOG2E,
        *query.stride(), *k_cache.stride(), *block_tables.stride(), *out.stride(),
        group_size, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_D=triton.next_power_of_2(head_dim),
        SOFTCAP=logit_softcap is not None,
        UPCAST=dot_in_fp32(query, k_cache),
    )
    return out
