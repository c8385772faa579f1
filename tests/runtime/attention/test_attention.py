"""The torch attention backend's decode buckets: how decodes are split by context length, and that a split
batch attends exactly as each request attending its own context alone would."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpi_kernels.reference import to_cache_dtype
from hpi_runtime.attention.metadata import AttentionMetadata
from hpi_runtime.attention.torch_backend import TorchAttentionBackend, split_decodes_by_context_len

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
COST = 256  # slots charged per group in the split tests


def _split(lengths: list[int], max_groups: int = 8, cost: int = COST) -> list[list[int]]:
    groups = split_decodes_by_context_len(torch.tensor(lengths, dtype=torch.int32), max_groups, cost)
    return [g.tolist() for g in groups]


def _price(lengths: list[int], groups: list[list[int]], cost: int = COST) -> int:
    return sum(len(g) * max(lengths[i] for i in g) + cost for g in groups)


def test_uniform_lengths_stay_one_group() -> None:
    assert _split([512] * 64) == [list(range(64))]


@pytest.mark.parametrize("lengths", [[], [700], [100, 130], [40, 41, 42, 45]], ids=["empty", "one", "two", "close"])
def test_small_batches_are_not_split(lengths) -> None:
    assert _split(lengths) == ([list(range(len(lengths)))] if lengths else [])


def test_max_groups_one_never_splits() -> None:
    assert _split([50, 1500, 60, 1400], max_groups=1) == [[0, 1, 2, 3]]


def test_two_clusters_split_apart() -> None:
    lengths = [1000, 20, 1010, 25, 30, 990]
    groups = _split(lengths)
    assert sorted(map(sorted, groups)) == [[0, 2, 5], [1, 3, 4]]


def test_group_count_is_capped() -> None:
    lengths = [100 * (i + 1) for i in range(16)]  # every split pays: 16 distinct, far apart lengths
    assert len(_split(lengths, max_groups=3)) == 3
    assert len(_split(lengths, max_groups=8)) == 8


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=7),
    max_groups=st.integers(1, 4),
    cost=st.sampled_from([0, 64, 256, 2000]),
)
def test_split_is_an_optimal_partition(lengths, max_groups, cost) -> None:
    """A partition into <= max_groups groups, each a run of the sorted lengths, with the brute-force optimum
    price (padded slots + cost per group) over all ways to cut the sorted lengths."""
    groups = _split(lengths, max_groups, cost)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert 1 <= len(groups) <= max_groups
    spans = sorted((min(lengths[i] for i in g), max(lengths[i] for i in g)) for g in groups)
    assert all(hi <= lo for (_, hi), (lo, _) in itertools.pairwise(spans)), "groups interleave in length"
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = min(
        _price(lengths, [order[a:b] for a, b in itertools.pairwise((0, *cuts, len(order)))], cost)
        for k in range(max_groups)
        for cuts in itertools.combinations(range(1, len(order)), k)
    )
    assert _price(lengths, groups, cost) == best


def _paged_step(context_lens: list[int], query_lens: list[int], seed: int = 0):
    """A step's common metadata plus q/k/v and caches; each request's blocks scattered in the cache."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-c // BLOCK_SIZE) for c in context_lens]
    num_blocks = sum(blocks_per_req) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_per_req) + 1, dtype=torch.int32)
    for row, n in enumerate(blocks_per_req):
        block_tables[row, :n] = torch.tensor(order[:n])
        order = order[n:]
    positions = [p for c, n in zip(context_lens, query_lens, strict=True) for p in range(c - n, c)]
    reqs = [r for r, n in enumerate(query_lens) for _ in range(n)]
    slots = [
        int(block_tables[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
        for r, p in zip(reqs, positions, strict=True)
    ]
    num_tokens = len(slots)
    common = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=block_tables,
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        num_decode_reqs=sum(1 for n in query_lens if n == 1),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        block_size=BLOCK_SIZE,
    )
    # q, k, v as strided slices of one fused projection, as the model passes them.
    qkv = torch.randn(num_tokens, NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, generator=generator)
    q, k, v = qkv.split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(cache_shape, generator=generator), torch.randn(cache_shape, generator=generator)
    return common, q, k, v, k_cache, v_cache


def _reference(common: AttentionMetadata, q, k, v, k_cache, v_cache) -> torch.Tensor:
    """Each request alone, in float64: its own keys read block by block, causal over its new tokens."""
    k_cache, v_cache = k_cache.clone().double(), v_cache.clone().double()
    k_flat, v_flat = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM), v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    k_flat[common.slot_mapping] = k.double()
    v_flat[common.slot_mapping] = v.double()
    out = torch.empty(q.shape, dtype=torch.float64)
    loc = common.query_start_loc.tolist()
    for r, context_len in enumerate(common.context_lens.tolist()):
        blocks = common.block_tables[r, : -(-context_len // BLOCK_SIZE)].long()
        keys = k_cache[blocks].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:context_len]  # [L, H_kv, D]
        values = v_cache[blocks].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:context_len]
        group_size = NUM_HEADS // NUM_KV_HEADS
        keys, values = keys.repeat_interleave(group_size, 1), values.repeat_interleave(group_size, 1)  # [L, H, D]
        for i, token in enumerate(range(loc[r], loc[r + 1])):
            visible = context_len - (loc[r + 1] - loc[r]) + i + 1
            scores = torch.einsum("hd,lhd->hl", q[token].double(), keys[:visible]) * HEAD_DIM**-0.5
            out[token] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values[:visible])
    return out


@pytest.mark.parametrize(
    ("context_lens", "query_lens"),
    [
        pytest.param([37, 1500, 50, 900, 33, 1490, 2, 60, 1200, 45], [1] * 10, id="decodes"),
        pytest.param([300, 17, 1100, 29, 64, 48], [1, 1, 1, 1, 20, 48], id="decodes-then-prefills"),
    ],
)
def test_bucketed_decodes_match_each_request_alone(context_lens, query_lens) -> None:
    common, q, k, v, k_cache, v_cache = _paged_step(context_lens, query_lens)
    expected = _reference(common, q, k, v, k_cache, v_cache)
    for max_groups in (1, 8):
        backend = TorchAttentionBackend(torch.float32, max_decode_groups=max_groups)
        metadata = backend.build_metadata(common)
        assert (len(metadata.decode_groups) > 1) == (max_groups > 1)  # the bucketed path is the one under test
        caches = k_cache.clone(), v_cache.clone()
        out = backend.forward(q, k, v, *caches, metadata, HEAD_DIM**-0.5)
        torch.testing.assert_close(
            out.double(), expected, atol=2e-6, rtol=1e-5, msg=lambda m, g=max_groups: f"max_decode_groups={g}: {m}"
        )


# -- the hpi::paged_attention op (what the compiled model calls) --------------------------------------------


def _kernel_params():
    from hpi_runtime.attention.op import PagedAttentionOpBackend

    kernel = pytest.param(True, id="cpu-kernel")
    queries = torch.empty(1, 1, HEAD_DIM)
    if not PagedAttentionOpBackend(torch.float32, prefer_cpu_kernel=True).uses_cpu_kernel(queries):
        kernel = pytest.param(True, id="cpu-kernel", marks=pytest.mark.skip(reason="C++ CPU attention not built"))
    return [kernel, pytest.param(False, id="reference")]


def _call_op(common: AttentionMetadata, q, k, v, k_cache, v_cache, prefer_cpu_kernel: bool) -> torch.Tensor:
    from hpi_runtime.attention.op import PagedAttentionOpBackend

    backend = PagedAttentionOpBackend(q.dtype, prefer_cpu_kernel=prefer_cpu_kernel)
    return backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(common), HEAD_DIM**-0.5)


@pytest.mark.parametrize("prefer_cpu_kernel", _kernel_params())
@pytest.mark.parametrize(
    ("context_lens", "query_lens"),
    [
        pytest.param([1], [1], id="one-token"),
        pytest.param([37, 1500, 50, 900, 33], [1] * 5, id="decodes"),
        pytest.param([300, 17, 64, 48], [1, 1, 20, 48], id="decodes-then-prefills"),
        pytest.param([40, 33], [40, 33], id="prefills"),
    ],
)
def test_op_matches_each_request_alone(context_lens, query_lens, prefer_cpu_kernel) -> None:
    common, q, k, v, k_cache, v_cache = _paged_step(context_lens, query_lens)
    expected = _reference(common, q, k, v, k_cache, v_cache)
    caches = k_cache.clone(), v_cache.clone()
    out = _call_op(common, q, k, v, *caches, prefer_cpu_kernel)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    written = caches[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[common.slot_mapping]
    torch.testing.assert_close(written, k)  # the new tokens' keys are in their slots


@pytest.mark.parametrize("prefer_cpu_kernel", _kernel_params())
def test_op_pad_rows_are_zero_and_write_nothing(prefer_cpu_kernel) -> None:
    """Rows past slot_mapping's length (padding) come out zero and write no cache slot."""
    common, q, k, v, k_cache, v_cache = _paged_step([30, 20], [1, 1])
    single = dataclasses.replace(common, slot_mapping=common.slot_mapping[:1], block_tables=common.block_tables[:1],
                                 query_start_loc=common.query_start_loc[:2], context_lens=common.context_lens[:1],
                                 num_decode_reqs=1)  # fmt: skip
    caches = k_cache.clone(), v_cache.clone()
    out = _call_op(single, q, k, v, *caches, prefer_cpu_kernel)
    expected = _reference(single, q[:1], k[:1], v[:1], k_cache, v_cache)
    torch.testing.assert_close(out[:1].double(), expected, atol=2e-5, rtol=1e-4)
    assert out.shape == q.shape and not out[1:].any()
    changed = (caches[0] != k_cache).any(-1).any(-1).flatten().nonzero().flatten()
    assert changed.tolist() == common.slot_mapping[:1].tolist()


@pytest.mark.parametrize("prefer_cpu_kernel", _kernel_params())
def test_op_bf16_is_close_to_fp32(prefer_cpu_kernel) -> None:
    common, q, k, v, k_cache, v_cache = _paged_step([300, 17, 64, 48], [1, 1, 20, 48])
    expected = _reference(common, q, k, v, k_cache, v_cache)
    bf16 = [t.bfloat16() for t in (q, k, v, k_cache, v_cache)]
    out = _call_op(common, *bf16, prefer_cpu_kernel)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("prefer_cpu_kernel", _kernel_params())
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
def test_op_over_a_converted_cache(cache_dtype, prefer_cpu_kernel) -> None:
    """`--kv-cache-dtype fp8*` and `bfloat16` under an fp32 model: the new rows are stored as to_cache_dtype rounds
    them, and attention is exact (fp32's tolerance) over the rounded cache, on the C++ kernel and the reference
    path alike."""
    common, q, k, v, k_cache, v_cache = _paged_step([300, 17, 64, 48], [1, 1, 20, 48])
    caches = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    expected = _reference(common, q, to_cache_dtype(k, cache_dtype).float(), to_cache_dtype(v, cache_dtype).float(),
                          caches[0].float(), caches[1].float())  # fmt: skip
    out = _call_op(common, q, k, v, *caches, prefer_cpu_kernel)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    written = caches[0].view(-1, NUM_KV_HEADS, HEAD_DIM)[common.slot_mapping]
    assert torch.equal(written.view(torch.uint8), to_cache_dtype(k, cache_dtype).view(torch.uint8))


@pytest.mark.parametrize("prefer_cpu_kernel", _kernel_params())
@pytest.mark.parametrize(("window", "softcap"), [(1, None), (6, None), (13, 2.0), (None, 1.5)])
def test_op_sliding_window_and_softcap(window, softcap, prefer_cpu_kernel) -> None:
    """Both paths against hpi_kernels' reference, with every block wholly before a request's first query's
    window pointed at a NaN-filled block (a placeholder the KV manager may put there): it must not be read."""
    from hpi_kernels.cpu import paged_attention_ref

    common, q, k, v, k_cache, v_cache = _paged_step([300, 17, 5, 64, 48], [1, 1, 1, 20, 48], seed=3)
    expected_caches = k_cache.clone(), v_cache.clone()
    for cache, new in zip(expected_caches, (k, v), strict=True):
        cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[common.slot_mapping] = new
    expected = torch.zeros(q.shape)
    paged_attention_ref(expected, q, *expected_caches, common.block_tables, common.query_start_loc,
                        common.context_lens, HEAD_DIM**-0.5, window, softcap)  # fmt: skip
    nan_block = k_cache.shape[0]
    caches = [torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in (k_cache, v_cache)]
    tables = common.block_tables.clone()
    if window is not None:
        query_lens = common.query_start_loc.diff().tolist()
        for r, (n, c) in enumerate(zip(query_lens, common.context_lens.tolist(), strict=True)):
            tables[r, : max(0, c - n - window + 1) // BLOCK_SIZE] = nan_block
    from hpi_runtime.attention.op import PagedAttentionOpBackend

    backend = PagedAttentionOpBackend(q.dtype, prefer_cpu_kernel=prefer_cpu_kernel)
    metadata = backend.build_metadata(dataclasses.replace(common, block_tables=tables))
    out = backend.forward(q, k, v, *caches, metadata, HEAD_DIM**-0.5, sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("prefer_cpu_kernel", _kernel_params())
def test_op_registration_is_consistent(prefer_cpu_kernel) -> None:
    """torch.library's own checks on the op the backend calls (the C++ kernel's or the reference's): the
    fake impl, the declared mutations and the schema match what it does."""
    from hpi_runtime.attention.op import PagedAttentionOpBackend

    common, q, k, v, k_cache, v_cache = _paged_step([30, 20, 9], [1, 1, 9])
    uses_kernel = PagedAttentionOpBackend(q.dtype, prefer_cpu_kernel=prefer_cpu_kernel).uses_cpu_kernel(q)
    assert uses_kernel == prefer_cpu_kernel
    op = torch.ops.hpi_kernels.cached_paged_attention_cpu if uses_kernel else torch.ops.hpi.paged_attention
    args = (q, k, v, k_cache, v_cache, common.slot_mapping, common.block_tables, common.query_start_loc,
            common.context_lens, HEAD_DIM**-0.5)  # fmt: skip
    torch.library.opcheck(op.default, args)
