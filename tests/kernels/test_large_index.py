"""Index overflow: caches with more than 2**31 elements need int64 offsets in every kernel.

On CPU the cache is a sparse file mapped into memory: 4 GiB of address space per cache, of which only
the few blocks the test touches ever get pages. On a GPU the cache is genuinely allocated.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache
from hpi_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

BLOCK_SIZE, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM = 16, 1, 2, 64
# One past 2**31 elements per cache, so block_id * stride_block overflows int32 for the last blocks.
NUM_BLOCKS = 2**31 // (BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM) + 4
CACHE_SHAPE = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def _check_kernels_at_the_top_of_the_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    device = k_cache.device
    blocks = [NUM_BLOCKS - 1, 7, NUM_BLOCKS - 3]  # the last block, a low one, and a high one
    context_len = 2 * BLOCK_SIZE + 9
    slots = [b * BLOCK_SIZE + offset for b in blocks for offset in range(BLOCK_SIZE)][:context_len]
    key = torch.randn(context_len, NUM_KV_HEADS, HEAD_DIM).to(device, k_cache.dtype)
    value = torch.randn(context_len, NUM_KV_HEADS, HEAD_DIM).to(device, k_cache.dtype)
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device=device))
    assert torch.equal(k_cache[NUM_BLOCKS - 1].flatten(), key[:BLOCK_SIZE].flatten())
    assert torch.equal(v_cache[NUM_BLOCKS - 3, :9].flatten(), value[2 * BLOCK_SIZE :].flatten())

    block_tables = torch.tensor([blocks], dtype=torch.int32, device=device)
    context_lens = torch.tensor([context_len], dtype=torch.int32, device=device)
    query = torch.randn(1, NUM_Q_HEADS, HEAD_DIM).to(device, k_cache.dtype)
    expected = paged_decode_attention_ref(query, k_cache, v_cache, block_tables, context_lens, 0.125)
    for num_splits in (1, 2):
        out = paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, 0.125, num_splits)
        torch.testing.assert_close(out, expected, atol=3e-3, rtol=1e-2)

    q_len = 20
    prefill_query = torch.randn(q_len, NUM_Q_HEADS, HEAD_DIM).to(device, k_cache.dtype)
    query_start_loc = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    args = (prefill_query, k_cache, v_cache, block_tables, query_start_loc, context_lens, 0.125)
    torch.testing.assert_close(
        paged_prefill_attention(*args), paged_prefill_attention_ref(*args), atol=3e-3, rtol=1e-2
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter variant; the gpu test covers CUDA")
def test_int64_offsets_with_a_sparse_file_backed_cache(tmp_path: Path) -> None:
    numel = NUM_BLOCKS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
    assert numel > 2**31
    path = tmp_path / "kv_cache.bin"
    with open(path, "wb") as f:
        f.truncate(2 * numel * torch.float16.itemsize)  # sparse: no disk or memory until touched
    storage = torch.from_file(str(path), shared=True, size=2 * numel, dtype=torch.float16)
    kv = storage.view(2, *CACHE_SHAPE)
    _check_kernels_at_the_top_of_the_cache(kv[0], kv[1])


@pytest.mark.gpu
def test_int64_offsets_with_a_large_gpu_cache() -> None:
    k_cache = torch.empty(CACHE_SHAPE, dtype=torch.float16, device="cuda")  # 4 GiB each, left unfilled
    v_cache = torch.empty(CACHE_SHAPE, dtype=torch.float16, device="cuda")
    _check_kernels_at_the_top_of_the_cache(k_cache, v_cache)
