"""Sliding-window attention and soft-capping in the Triton paged kernels, against the PyTorch references.

Blocks wholly before a request's first query's window are filled with NaN after the reference ran: the KV
manager may point them at a shared placeholder, so a kernel that read one would return NaN.
"""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import paged_decode_attention, paged_prefill_attention
from hpi_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 8


def _poison_outside_windows(cache, query_lens: list[int], window: int) -> None:
    tables = cache.block_tables.cpu()
    for r, (query_len, context_len) in enumerate(zip(query_lens, cache.context_lens.tolist(), strict=True)):
        first_key = max(0, context_len - max(query_len, 1) - window + 1)
        for b in range(first_key // BLOCK_SIZE):
            cache.k_cache[int(tables[r, b])] = float("nan")
            cache.v_cache[int(tables[r, b])] = float("nan")


@pytest.mark.parametrize(
    "window,softcap,num_splits",
    [(1, None, 1), (5, None, 3), (16, 2.0, 1), (40, None, 2), (None, 1.5, 2), (7, 3.0, 4)],
)
def test_decode_window_and_softcap(paged_cache, device, window, softcap, num_splits) -> None:
    context_lens = [1, 7, 8, 9, 45, 100]
    cache = paged_cache(context_lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, seed=1)
    query = torch.randn(len(context_lens), NUM_HEADS, HEAD_DIM, device=device)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, HEAD_DIM**-0.5)
    expected = paged_decode_attention_ref(*args, sliding_window=window, logit_softcap=softcap)
    if window is not None:
        _poison_outside_windows(cache, [1] * len(context_lens), window)
    out = paged_decode_attention(*args, num_splits, sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


PREFILL_BATCH = [(30, 30), (50, 18), (17, 1), (70, 70), (9, 0), (3, 2)]  # (context_len, query_len)


@pytest.mark.parametrize("window,softcap", [(1, None), (5, 2.0), (16, None), (40, 1.5), (None, 2.0)])
def test_prefill_window_and_softcap(paged_cache, device, window, softcap) -> None:
    context_lens, query_lens = [c for c, _ in PREFILL_BATCH], [q for _, q in PREFILL_BATCH]
    cache = paged_cache(context_lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, seed=2)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device=device)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device=device)  # fmt: skip
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, query_start_loc, cache.context_lens,
            HEAD_DIM**-0.5)  # fmt: skip
    expected = paged_prefill_attention_ref(*args, sliding_window=window, logit_softcap=softcap)
    if window is not None:
        _poison_outside_windows(cache, query_lens, window)
    out = paged_prefill_attention(*args, sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("launcher", ["decode", "prefill"])
def test_bad_window_or_softcap(paged_cache, device, launcher) -> None:
    cache = paged_cache([5], NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    query = torch.randn(1, NUM_HEADS, HEAD_DIM, device=device)
    if launcher == "decode":
        args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.1)
        run = paged_decode_attention
    else:
        loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
        args = (query, cache.k_cache, cache.v_cache, cache.block_tables, loc, cache.context_lens, 0.1)
        run = paged_prefill_attention
    with pytest.raises(ValueError, match="sliding_window"):
        run(*args, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        run(*args, logit_softcap=0.0)
