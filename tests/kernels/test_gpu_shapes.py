"""The kernels compiled for a real GPU at realistic sizes: bf16, head 128, long contexts, M up to 512.

Everything here needs CUDA: the interpreter cannot check tl.dot's minimum tile sizes, bf16 arithmetic,
launch configurations or the speed-oriented tile choices these shapes select.
"""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import (
    int4_weight_only_matmul,
    int8_weight_only_matmul,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv_cache,
)
from hpi_kernels.quant import quantize_int4, quantize_int8
from hpi_kernels.reference import (
    int4_weight_only_matmul_ref,
    int8_weight_only_matmul_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    write_kv_cache_ref,
)

pytestmark = pytest.mark.gpu
ATTENTION_TOL = {"atol": 2e-2, "rtol": 2e-2}


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,head_dim,block_size",
    [(32, 8, 128, 16), (9, 3, 64, 32), (8, 1, 128, 32)],
)
@pytest.mark.parametrize("batch,max_context,num_splits", [(1, 32768, None), (64, 4096, None), (4, 8192, 8)])
def test_decode_realistic(
    paged_cache, dtype, num_q_heads, num_kv_heads, head_dim, block_size, batch, max_context, num_splits
) -> None:
    generator = torch.Generator().manual_seed(batch)
    context_lens = torch.randint(1, max_context + 1, (batch,), generator=generator).tolist()
    context_lens[0] = max_context
    cache = paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(batch, num_q_heads, head_dim, device="cuda", dtype=dtype)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, head_dim**-0.5)
    out = paged_decode_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **ATTENTION_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", [(32, 8, 128, 16), (9, 3, 64, 32)])
def test_prefill_realistic(paged_cache, dtype, num_q_heads, num_kv_heads, head_dim, block_size) -> None:
    # (context_len, q_len): a long new prompt, decodes, a chunk over a long prefix, a prefix-cache hit.
    batch = [(512, 512), (3000, 1), (17, 1), (2300, 300), (1077, 77)]
    context_lens = [c for c, _ in batch]
    q_lens = torch.tensor([q for _, q in batch])
    cache = paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(int(q_lens.sum()), num_q_heads, head_dim, device="cuda", dtype=dtype)
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to("cuda", torch.int32)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.context_lens)
    out = paged_prefill_attention(*args, head_dim**-0.5)
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args, head_dim**-0.5), **ATTENTION_TOL)


@pytest.mark.parametrize(("window", "softcap"), [(4096, None), (1024, 50.0), (511, None)])
def test_sliding_window_and_softcap_realistic(paged_cache, window, softcap) -> None:
    """Gemma 2 / Mistral shapes: decodes (split-KV) and chunks past the window, soft-capped scores."""
    head_dim, block_size, dtype = 128, 16, torch.bfloat16
    batch = [(8192, 1), (6000, 1), (300, 1), (5000, 700), (2100, 2100)]  # (context_len, q_len)
    context_lens = [c for c, _ in batch]
    cache = paged_cache(context_lens, 8, head_dim, block_size, dtype)
    decode_args = (torch.randn(3, 16, head_dim, device="cuda", dtype=dtype), cache.k_cache, cache.v_cache,
                   cache.block_tables[:3], cache.context_lens[:3], head_dim**-0.5)  # fmt: skip
    window_args = {"sliding_window": window, "logit_softcap": softcap}
    out = paged_decode_attention(*decode_args, num_splits=4, **window_args)
    torch.testing.assert_close(out, paged_decode_attention_ref(*decode_args, **window_args), **ATTENTION_TOL)
    q_lens = torch.tensor([q for _, q in batch[3:]])
    query = torch.randn(int(q_lens.sum()), 16, head_dim, device="cuda", dtype=dtype)
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to("cuda", torch.int32)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables[3:], query_start_loc, cache.context_lens[3:],
            head_dim**-0.5)  # fmt: skip
    out = paged_prefill_attention(*args, **window_args)
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args, **window_args), **ATTENTION_TOL)


def test_write_kv_cache_realistic(paged_cache) -> None:
    cache = paged_cache([4096], 8, 128, 16, torch.bfloat16)
    num_slots = cache.k_cache.shape[0] * cache.k_cache.shape[1]
    slots = torch.randperm(num_slots, device="cuda")[:1000]
    slots[::7] = -1
    key = torch.randn(1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_expected, v_expected = cache.k_cache.clone(), cache.v_cache.clone()
    write_kv_cache_ref(key, value, k_expected, v_expected, slots)
    write_kv_cache(key, value, cache.k_cache, cache.v_cache, slots)
    assert torch.equal(cache.k_cache, k_expected) and torch.equal(cache.v_cache, v_expected)


@pytest.mark.parametrize("m", [1, 7, 16, 64, 200, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_matmul_realistic(m, dtype) -> None:
    weight, scales = quantize_int8(torch.randn(4096, 4096, device="cuda", dtype=dtype))
    x = torch.randn(m, 4096, device="cuda", dtype=dtype)
    out = int8_weight_only_matmul(x, weight, scales)
    assert _relative_error(out, int8_weight_only_matmul_ref(x, weight, scales)) < 1e-2


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("m", [1, 7, 16, 64, 200, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_matmul_realistic(m, dtype, group_size) -> None:
    packed, scales, zeros = quantize_int4(torch.randn(11008, 4096, device="cuda", dtype=dtype), group_size)
    x = torch.randn(m, 4096, device="cuda", dtype=dtype)
    out = int4_weight_only_matmul(x, packed, scales, zeros, group_size)
    expected = int4_weight_only_matmul_ref(x, packed, scales, zeros, group_size)
    assert _relative_error(out, expected) < 1e-2
