"""Paged prefill/extend attention (varlen, causal over the cached prefix) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import paged_decode_attention, paged_prefill_attention
from hpi_kernels.reference import paged_prefill_attention_ref

# (context_len, q_len) per request; context_len counts this step's q_len new tokens.
SHORT_MIXED = [
    (1, 1),  # first token of a one-token prompt
    (17, 1),  # decode one past a block boundary
    (37, 5),  # chunk over a cached prefix that ends mid-block
    (16, 16),  # a whole new prompt, exactly one block
    (9, 0),  # a request with nothing to compute this step
]
LONG_MIXED = [
    (20, 20),  # new prompt crossing a block boundary
    (50, 18),  # chunked-prefill continuation over a 32-token (block-aligned) prefix
    (17, 1),  # decode
    (70, 70),  # new prompt longer than one 64-row query tile
]

CASES = [
    # (batch, num_q_heads, num_kv_heads, head_dim, block_size, dtype, non_contiguous)
    pytest.param(SHORT_MIXED, 9, 3, 64, 16, torch.float32, False, id="short-gqa9:3-d64-bs16-fp32"),
    pytest.param(SHORT_MIXED, 8, 1, 128, 32, torch.float16, True, id="short-gqa8:1-d128-bs32-fp16-noncontig"),
    pytest.param(LONG_MIXED, 9, 3, 64, 32, torch.float16, False, id="long-gqa9:3-d64-bs32-fp16"),
    pytest.param(LONG_MIXED, 8, 1, 64, 16, torch.float32, True, id="long-gqa8:1-d64-bs16-fp32-noncontig"),
    pytest.param(SHORT_MIXED, 6, 2, 64, 16, torch.bfloat16, False, id="short-gqa6:2-d64-bs16-bf16"),
]


def _inputs(paged_cache, device, batch, num_q_heads, num_kv_heads, head_dim, block_size, dtype, non_contiguous):
    context_lens = [c for c, _ in batch]
    q_lens = [q for _, q in batch]
    cache = paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, non_contiguous)
    num_tokens = sum(q_lens)
    if non_contiguous:
        qkv = torch.randn(num_tokens, 2 * num_q_heads * head_dim).to(device, dtype)
        query = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    else:
        query = torch.randn(num_tokens, num_q_heads, head_dim).to(device, dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return query, cache, query_start_loc


@pytest.mark.parametrize(
    "batch,num_q_heads,num_kv_heads,head_dim,block_size,dtype,non_contiguous", CASES
)
def test_prefill_matches_reference(
    paged_cache, tol, device, batch, num_q_heads, num_kv_heads, head_dim, block_size, dtype, non_contiguous
) -> None:
    torch.manual_seed(0)
    query, cache, query_start_loc = _inputs(
        paged_cache, device, batch, num_q_heads, num_kv_heads, head_dim, block_size, dtype, non_contiguous
    )
    scale = head_dim**-0.5
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.context_lens, scale)
    max_query_len = max(q for _, q in batch) if non_contiguous else None  # both ways of getting it
    out = paged_prefill_attention(*args, max_query_len=max_query_len)
    expected = paged_prefill_attention_ref(*args)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **tol(dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
def test_prefill_reads_a_converted_cache(paged_cache, tol, device, cache_dtype) -> None:
    """fp32 queries over a one-byte or a bf16 cache (`--kv-cache-dtype fp8*`, `bfloat16`)."""
    cache = paged_cache([40, 23], 3, 64, 16, cache_dtype)
    query = torch.randn(30, 9, 64, device=device)  # 20 new tokens of the first request, 10 of the second
    query_start_loc = torch.tensor([0, 20, 30], dtype=torch.int32, device=device)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.context_lens, 0.125)
    torch.testing.assert_close(paged_prefill_attention(*args), paged_prefill_attention_ref(*args),
                               **tol(torch.float32))  # fmt: skip


def test_prefill_of_single_tokens_equals_decode(paged_cache, device) -> None:
    cache = paged_cache([1, 16, 40], num_kv_heads=3, head_dim=64, block_size=16)
    query = torch.randn(3, 9, 64, device=device)
    query_start_loc = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=device)
    prefill = paged_prefill_attention(
        query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.context_lens, 0.125
    )
    decode = paged_decode_attention(
        query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125
    )
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"query_start_loc": torch.tensor([0, 3], dtype=torch.int32)}, "query_start_loc.shape"),
        ({"query_start_loc": torch.tensor([0, 1, 3], dtype=torch.int64)}, "query_start_loc must have dtype"),
        ({"context_lens": torch.tensor([5, 9], dtype=torch.int64)}, "context_lens must have dtype"),
        ({"block_tables": torch.zeros(1, 2, dtype=torch.int32)}, "block_tables.shape"),
        ({"query": torch.randn(3, 4, 64).to(torch.bfloat16)}, "dtype"),
        ({"query": torch.randn(3, 5, 64)}, "multiple of num_kv_heads"),
    ],
)
def test_prefill_validation(paged_cache, overrides, message) -> None:
    cache = paged_cache([5, 9], num_kv_heads=2, head_dim=64, block_size=16, device=torch.device("cpu"))
    args = {
        "query": torch.randn(3, 4, 64),
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "block_tables": cache.block_tables,
        "query_start_loc": torch.tensor([0, 1, 3], dtype=torch.int32),
        "context_lens": cache.context_lens,
        "scale": 0.125,
    }
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**args)
