"""Paged attention on CPU that reads K/V in place from the paged cache, and its plain-PyTorch reference.

One call covers a mixed batch: request r's query tokens are rows query_start_loc[r]:query_start_loc[r + 1]
of q; their own K/V are already in the cache, so context_lens[r] counts them, and query i of the chunk
(query_len tokens) sits at position context_lens[r] - query_len + i and attends causally to cache
positions 0..that position, read through the request's row of block_tables. With `sliding_window` W it
attends positions position - W + 1..position only, and blocks wholly before the window are not read; with
`logit_softcap` C, scores (already scaled) become C * tanh(score / C) before masking. GQA: q head h reads
kv head h // (num_heads // num_kv_heads). Rows of `out` that belong to no request are left as they are.
"""

from __future__ import annotations

import torch

from hpi_kernels.cpu._extension import load_extension
from hpi_kernels.reference import gather_kv


def prefill_attention_tile(choice: str = "") -> str:
    """How prefill/extend rows of a bf16 model over a bf16 or fp8 cache are attended: "amx" (AMX tiles for the
    scores and the values, paged_attention_amx.cpp; CPUs with AMX-BF16 only, head dims a multiple of 32, no
    soft-cap) or "vector" (fp32 FMAs, every CPU). "" returns the current choice: "amx" where the CPU has AMX-BF16 unless
    HPI_CPU_ATTENTION_TILE=vector set it; a name forces that tile (tests run each the CPU has). ValueError for
    another name, or "amx" on a CPU without it."""
    load_extension()
    return torch.ops.hpi_kernels.prefill_attention_tile(choice)


def paged_attention_cpu(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] contiguous, written in place
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]; may be a strided view (last dim contiguous)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32, padded
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32, tokens in the cache incl. this step's new ones
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    """The C++ kernel (torch.ops.hpi_kernels.paged_attention_cpu); builds it on first use.

    float32, bfloat16 or float16 (q, caches and out alike), fp32 math; head_dim a multiple of 16.
    Bad arguments raise ValueError; a missing toolchain raises CpuKernelBuildError.
    """
    load_extension()
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap}")
    torch.ops.hpi_kernels.paged_attention_cpu(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        sliding_window or 0,
        logit_softcap or 0.0,
    )


def cached_paged_attention_cpu(
    q: torch.Tensor,  # [num_rows, num_heads, head_dim]; rows past slot_mapping's length are padding
    k: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]: the step's new keys (last dim contiguous)
    v: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous, written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous, written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64: cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32, padded
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32, incl. the new tokens
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_rows, num_heads, head_dim]; pad rows are zeros
    """Write the new tokens' K/V into their slots, then paged_attention_cpu over the cache, in one op call
    (torch.ops.hpi_kernels.cached_paged_attention_cpu, which the compiled model calls directly)."""
    load_extension()
    return torch.ops.hpi_kernels.cached_paged_attention_cpu(
        q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start_loc, context_lens, scale,
        sliding_window or 0, logit_softcap or 0.0,
    )  # fmt: skip


def paged_attention_ref(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> None:
    """Slow and obvious: per request, gather its context, mask causally (and by the window), softmax in fp32."""
    group_size = q.shape[1] // k_cache.shape[2]
    starts = query_start_loc.tolist()
    for r, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[r], starts[r + 1]
        if q_end == q_start:
            continue
        key = gather_kv(k_cache, block_tables[r], context_len).float().repeat_interleave(group_size, dim=1)
        value = gather_kv(v_cache, block_tables[r], context_len).float().repeat_interleave(group_size, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), key) * scale  # [H, Q, K]
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        positions = torch.arange(context_len - (q_end - q_start), context_len)
        hidden = torch.arange(context_len)[None, :] > positions[:, None]  # [Q, K]
        if sliding_window is not None:
            hidden |= torch.arange(context_len)[None, :] <= positions[:, None] - sliding_window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, value).to(out.dtype)
