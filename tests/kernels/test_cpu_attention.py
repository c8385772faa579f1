"""C++ CPU paged attention (hpi_kernels.cpu) against its plain-PyTorch reference.

The module fixture builds the extension (~15 s the first time on a machine, cached after). A failed
build fails these tests rather than skipping them: every machine the project runs on has g++, and ninja
is a dependency of hpi-kernels.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hpi_kernels.cpu import cpu_capability, cpu_kernels_available, load_extension
from hpi_kernels.cpu.paged_attention import paged_attention_cpu, paged_attention_ref, prefill_attention_tile
from hpi_kernels.reference import to_cache_dtype

TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-2, "rtol": 2e-2},
}
PAD_BLOCK_ID = 2**30  # padded block-table entries: reading one would fail the kernel's bounds check
SENTINEL = 7.0  # out rows that no request owns keep it


@pytest.fixture(scope="module", autouse=True)
def extension() -> str:
    return load_extension()


@dataclass(frozen=True)
class Batch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], possibly a slice of a fused qkv tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    context_lens: torch.Tensor  # [num_reqs] int32

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc, self.context_lens)


def make_batch(
    requests: list[tuple[int, int]],  # (query_len, context_len) per request
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    fused_qkv: bool = False,
    seed: int = 0,
) -> Batch:
    """Random K/V in scattered, shuffled blocks; every cache slot that no request may read holds NaN."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-context_len // block_size) for _, context_len in requests]
    num_blocks = sum(blocks_per_req) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.full((len(requests), max(blocks_per_req) + 1), PAD_BLOCK_ID, dtype=torch.int32)
    for r, ((_, context_len), n) in enumerate(zip(requests, blocks_per_req, strict=True)):
        blocks, order = order[:n], order[n:]
        block_tables[r, :n] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor(blocks)[:, None] * block_size + torch.arange(block_size)
        slots = slots.flatten()[:context_len]
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
                context_len, num_kv_heads, head_dim, generator=generator
            ).to(dtype)
    query_lens = torch.tensor([query_len for query_len, _ in requests])
    num_tokens = int(query_lens.sum())
    width = (num_heads + 2 * num_kv_heads) * head_dim if fused_qkv else num_heads * head_dim
    qkv = torch.randn(num_tokens, width, generator=generator).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    context_lens = torch.tensor([context_len for _, context_len in requests], dtype=torch.int32)
    return Batch(q, k_cache, v_cache, block_tables, query_start_loc, context_lens)


def mixed_requests(block_size: int) -> list[tuple[int, int]]:
    """Decodes at and around block boundaries, extends over a cached prefix, full prefills, an idle request."""
    return [
        (1, 1),
        (1, block_size - 1),
        (1, block_size),
        (1, block_size + 1),
        (1, 3 * block_size + 5),
        (7, 7 + 2 * block_size + 3),  # extend: a prefix ending mid-block
        (40, 100),
        (0, 20),  # scheduled with no new tokens: owns no rows
        (50, 50),  # full prefill
        (block_size + 1, block_size + 1),
        (1, 70),  # a decode after the prefills: the kernel does not rely on the runner's order
    ]


def run_both(batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full(batch.q.shape, SENTINEL, dtype=batch.q.dtype)
    expected = out.clone()
    paged_attention_cpu(out, *batch.args(), scale)
    paged_attention_ref(expected, *batch.args(), scale)
    return out, expected


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS = [pytest.param(4, 4, id="mha"), pytest.param(9, 3, id="gqa9:3"), pytest.param(8, 2, id="gqa8:2")]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size) -> None:
    batch = make_batch(mixed_requests(block_size), num_heads, num_kv_heads, head_dim, block_size, dtype)
    out, expected = run_both(batch, head_dim**-0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", [*HEADS, pytest.param(8, 1, id="gqa8:1")])
@pytest.mark.parametrize("head_dim", [48, 80, 128])
def test_decode_head_dims_in_every_value_chunking(dtype, num_heads, num_kv_heads, head_dim) -> None:
    """Decodes only: a decode item's P @ V pass takes its head dim in groups of up to 4 vectors per head (fewer with
    more heads a kv head), then one at a time for the rest; 48 and 80 leave a rest (3 and 5 vectors in the AVX512
    build, 6 and 10 in the AVX2 one), 1, 3, 4 and 8 heads a kv head give each group size."""
    requests = [(1, n) for n in (1, 15, 16, 17, 70, 129)]
    batch = make_batch(requests, num_heads, num_kv_heads, head_dim, 16, dtype, seed=6)
    out, expected = run_both(batch, head_dim**-0.5)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


FP8_CACHES = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8_CACHES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16])
def test_fp8_cache_matches_reference(cache_dtype, dtype, block_size) -> None:
    """An fp8 cache (`--kv-cache-dtype fp8*`) is widened exactly: fp32 queries meet fp32's tolerance against the
    reference over the same fp8 values, decodes (decode_item) and prefill tiles (tile_item) alike. Keys up to
    +-12 and small values reach both formats' subnormals and their top binades."""
    batch = make_batch(mixed_requests(block_size), 9, 3, 64, block_size, dtype, seed=3)
    batch = dataclasses.replace(batch, k_cache=(batch.k_cache.float() * 4).to(cache_dtype),
                                v_cache=(batch.v_cache.float() * 0.02).to(cache_dtype))  # fmt: skip
    out, expected = run_both(batch, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [8, 16])
def test_bf16_cache_under_wider_queries_matches_reference(dtype, block_size) -> None:
    """`--kv-cache-dtype bfloat16` under an fp32 (or fp16) model: the cache is widened exactly, so fp32 queries
    meet fp32's tolerance against the reference over the same bf16 values, decodes and prefill tiles alike."""
    batch = make_batch(mixed_requests(block_size), 9, 3, 64, block_size, dtype, seed=4)
    batch = dataclasses.replace(batch, k_cache=batch.k_cache.bfloat16(), v_cache=batch.v_cache.bfloat16())
    out, expected = run_both(batch, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("cache_dtype", FP8_CACHES, ids=str)
def test_every_fp8_code_is_widened_exactly(cache_dtype) -> None:
    """All 256 codes but NaN and inf (zero there), 64 a request as the values of its one key: the output is that
    value row exactly (one key takes all the weight). Subnormals included: they once took a path that multiplied
    subnormal floats, exact but slow on Intel CPUs (a microcode assist each)."""
    bits = torch.arange(256, dtype=torch.uint8)
    codes = torch.where(torch.isfinite(bits.view(cache_dtype).float()), bits, 0).view(cache_dtype)
    block_size, head_dim, reqs = 16, 64, 4
    v_cache = torch.zeros(reqs, block_size, 1, head_dim, dtype=cache_dtype)
    v_cache[:, 0, 0] = codes.view(reqs, head_dim)
    k_cache = torch.ones(reqs, block_size, 1, head_dim).to(cache_dtype)
    q = torch.randn(reqs, 1, head_dim)
    out = torch.empty_like(q)
    block_tables = torch.arange(reqs, dtype=torch.int32).view(reqs, 1)
    query_start_loc, context_lens = torch.arange(reqs + 1, dtype=torch.int32), torch.ones(reqs, dtype=torch.int32)
    torch.ops.hpi_kernels.paged_attention_cpu(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                              0.125, 0, 0.0)  # fmt: skip
    expected = codes.float().view(reqs, 1, head_dim)
    assert torch.equal(out, expected)  # the subnormals too (-0.0 sums to +0.0 from the zero accumulator: equal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_sliced_from_fused_qkv(dtype) -> None:
    batch = make_batch(mixed_requests(16), 9, 3, 64, 16, dtype, fused_qkv=True, seed=1)
    assert not batch.q.is_contiguous()
    out, expected = run_both(batch, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [pytest.param(12, 1, id="mqa12"), pytest.param(20, 2, id="gqa20:2"), pytest.param(7, 7, id="mha7")],
)
def test_wide_and_odd_groups(dtype, num_heads, num_kv_heads) -> None:
    # Decode groups above 8 q heads are split into chunks; prefill tiles end mid-group.
    batch = make_batch([(1, 33), (1, 200), (30, 90), (5, 5)], num_heads, num_kv_heads, 64, 16, dtype, seed=2)
    out, expected = run_both(batch, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_chunks(dtype) -> None:
    # Many query tiles per request, a cached prefix, and tiles whose rows straddle the causal diagonal.
    batch = make_batch([(300, 400), (257, 257), (1, 1500)], 9, 3, 64, 16, dtype, fused_qkv=True, seed=3)
    out, expected = run_both(batch, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def blocks_outside_windows(batch: Batch, window: int) -> Batch:
    """`batch` with every block-table entry wholly before the window of a request's first query replaced by
    an id outside the cache: the KV manager may free those blocks, so the kernel must never read them."""
    block_size = batch.k_cache.shape[1]
    tables = batch.block_tables.clone()
    query_lens = batch.query_start_loc.diff().tolist()
    for r, (query_len, context_len) in enumerate(zip(query_lens, batch.context_lens.tolist(), strict=True)):
        first_key = max(0, context_len - max(query_len, 1) - window + 1)
        tables[r, : first_key // block_size] = PAD_BLOCK_ID
    return Batch(batch.q, batch.k_cache, batch.v_cache, tables, batch.query_start_loc, batch.context_lens)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [1, 5, 16, 37])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["no-cap", "softcap"])
def test_sliding_window_and_softcap(dtype, window, softcap) -> None:
    # Decodes and chunks longer and shorter than the window; tiles whose rows start in different blocks.
    requests = [*mixed_requests(16), (100, 230), (1, 300)]
    batch = make_batch(requests, 9, 3, 64, 16, dtype, fused_qkv=True, seed=5)
    out = torch.full(batch.q.shape, SENTINEL, dtype=dtype)
    expected = out.clone()
    paged_attention_cpu(out, *blocks_outside_windows(batch, window).args(), 0.125, window, softcap)
    paged_attention_ref(expected, *batch.args(), 0.125, window, softcap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    if window < 37:  # the window changes the result
        full = torch.full(batch.q.shape, SENTINEL, dtype=dtype)
        paged_attention_ref(full, *batch.args(), 0.125, None, softcap)
        assert not torch.allclose(full, expected)


def _with_tile(tile: str, batch: Batch, window: int | None = None) -> torch.Tensor:
    previous = prefill_attention_tile()
    try:
        prefill_attention_tile(tile)
        out = torch.full(batch.q.shape, SENTINEL, dtype=batch.q.dtype)
        paged_attention_cpu(out, *batch.args(), batch.q.shape[-1] ** -0.5, window)
        return out
    finally:
        prefill_attention_tile(previous)


def _has_amx() -> bool:
    try:
        previous = prefill_attention_tile()
        prefill_attention_tile("amx")
        prefill_attention_tile(previous)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("tile", ["vector", "amx"])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 37])
def test_each_prefill_tile_matches_the_reference(tile, num_heads, num_kv_heads, head_dim, block_size, window) -> None:
    """bf16 prefill/extend rows on each tile this CPU has: the vector tile, and AMX's (scores and values on AMX
    tiles, the probabilities rounded to bf16; paged_attention_amx.cpp). Chunks that start mid-block, a cached
    prefix, rows that straddle the diagonal, keys in partial chunks of 32, head dims of 2, 3 and 4 tiles of 32,
    a window that starts mid-chunk. The AMX tile's results differ from the vector tile's (it ran)."""
    if tile == "amx" and not _has_amx():
        pytest.skip("this CPU has no AMX-BF16 tiles (the vector tile is tested on it)")
    requests = [*mixed_requests(block_size), (300, 400), (45, 45), (1, 90)]
    batch = make_batch(requests, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=7)
    expected = torch.full(batch.q.shape, SENTINEL, dtype=torch.bfloat16)
    paged_attention_ref(expected, *batch.args(), head_dim**-0.5, window)
    out = _with_tile(tile, batch, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])
    if tile == "amx":
        assert not torch.equal(out, _with_tile("vector", batch, window))


@pytest.mark.parametrize("cache_dtype", FP8_CACHES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16])
def test_the_amx_prefill_tile_reads_fp8_caches(cache_dtype, head_dim, block_size) -> None:
    """An fp8 cache's keys and values are widened to bf16 (exactly) for the AMX tiles: the result meets bf16's
    tolerance against the reference over the same fp8 values, as the vector tile's does, and differs from it."""
    if not _has_amx():
        pytest.skip("this CPU has no AMX-BF16 tiles (test_fp8_cache_matches_reference covers the vector tile)")
    requests = [*mixed_requests(block_size), (300, 400), (45, 45)]
    batch = make_batch(requests, 9, 3, head_dim, block_size, torch.bfloat16, seed=8)
    batch = dataclasses.replace(batch, k_cache=(batch.k_cache.float() * 4).to(cache_dtype),
                                v_cache=(batch.v_cache.float() * 0.02).to(cache_dtype))  # fmt: skip
    expected = torch.full(batch.q.shape, SENTINEL, dtype=torch.bfloat16)
    paged_attention_ref(expected, *batch.args(), head_dim**-0.5)
    out = _with_tile("amx", batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])
    assert not torch.equal(out, _with_tile("vector", batch))


def test_prefill_attention_tile_names_are_checked() -> None:
    with pytest.raises(ValueError, match="must be amx or vector"):
        prefill_attention_tile("tiles")
    if not _has_amx():
        with pytest.raises(ValueError, match="no AMX-BF16 tiles"):
            prefill_attention_tile("amx")
    assert prefill_attention_tile() in ("amx", "vector")


def test_thread_count_does_not_change_the_result() -> None:
    batch = make_batch(mixed_requests(16), 9, 3, 64, 16, torch.float32, seed=4)
    outs = []
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            out = torch.full(batch.q.shape, SENTINEL)
            paged_attention_cpu(out, *batch.args(), 0.125)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


BIG_BLOCK_SIZE, BIG_HEAD_DIM = 16, 64
BIG_NUM_BLOCKS = 2**31 // (BIG_BLOCK_SIZE * BIG_HEAD_DIM) + 4  # one kv head: past 2**31 elements per cache


def test_int64_offsets_with_a_sparse_file_backed_cache(tmp_path: Path) -> None:
    shape = (BIG_NUM_BLOCKS, BIG_BLOCK_SIZE, 1, BIG_HEAD_DIM)
    numel = BIG_NUM_BLOCKS * BIG_BLOCK_SIZE * BIG_HEAD_DIM
    path = tmp_path / "kv_cache.bin"
    with open(path, "wb") as f:
        f.truncate(2 * numel * torch.bfloat16.itemsize)  # sparse: no disk or memory until touched
    kv = torch.from_file(str(path), shared=True, size=2 * numel, dtype=torch.bfloat16).view(2, *shape)
    k_cache, v_cache = kv[0], kv[1]
    blocks = [BIG_NUM_BLOCKS - 1, 7, BIG_NUM_BLOCKS - 3]
    for block in blocks:
        k_cache[block] = torch.randn(BIG_BLOCK_SIZE, 1, BIG_HEAD_DIM).bfloat16()
        v_cache[block] = torch.randn(BIG_BLOCK_SIZE, 1, BIG_HEAD_DIM).bfloat16()
    context_len = 2 * BIG_BLOCK_SIZE + 9
    block_tables = torch.tensor([blocks, blocks], dtype=torch.int32)
    batch = Batch(
        q=torch.randn(21, 2, BIG_HEAD_DIM).bfloat16(),  # a decode, then a 20-token extend
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start_loc=torch.tensor([0, 1, 21], dtype=torch.int32),
        context_lens=torch.tensor([context_len, context_len], dtype=torch.int32),
    )
    out, expected = run_both(batch, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


def _valid_args() -> dict:
    batch = make_batch([(1, 20), (3, 9)], 4, 2, 64, 16, torch.float32)
    return {
        "out": torch.empty(batch.q.shape),
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_tables": batch.block_tables,
        "query_start_loc": batch.query_start_loc,
        "context_lens": batch.context_lens,
        "scale": 0.125,
    }


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"q": torch.randn(4, 4, 64, dtype=torch.float64)}, "float32, bfloat16 or float16"),
        ({"q": torch.randn(4, 4, 64).bfloat16()}, "must both have q's dtype"),
        ({"q": torch.randn(4, 3, 64), "out": torch.empty(4, 3, 64)}, "multiple of num_kv_heads"),
        ({"q": torch.randn(4, 4, 128)[..., ::2]}, "contiguous last dim"),
        ({"out": torch.empty(4, 4, 64).transpose(0, 1).contiguous().transpose(0, 1)}, "out must be"),
        ({"k_cache": torch.zeros(6, 16, 2, 48), "v_cache": torch.zeros(6, 16, 2, 48)}, "head_dim"),
        ({"v_cache": torch.zeros(6, 16, 2, 64).transpose(0, 1).contiguous().transpose(0, 1)}, "v_cache must be"),
        ({"block_tables": torch.zeros(2, 3, dtype=torch.int64)}, "block_tables must be"),
        ({"context_lens": torch.tensor([20, 2], dtype=torch.int32)}, "must count the query's own 3 tokens"),
        ({"context_lens": torch.tensor([20, 200], dtype=torch.int32)}, "exceeds block_tables"),
        ({"query_start_loc": torch.tensor([0, 1, 9], dtype=torch.int32)}, "<= num_tokens"),
        ({"query_start_loc": torch.tensor([0, 1], dtype=torch.int32)}, "query_start_loc must be"),
        ({"block_tables": torch.tensor([[0, 1], [99, 0]], dtype=torch.int32)}, "outside the cache"),
        ({"sliding_window": 0}, "sliding_window must be"),
        ({"logit_softcap": -1.0}, "logit_softcap must be"),
    ],
)
def test_bad_arguments_raise_value_error(overrides, message) -> None:
    args = _valid_args()
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        paged_attention_cpu(**args)


def test_op_schema_and_fake_kernel() -> None:
    # The mutation annotation and fake kernel are what torch.compile needs to keep the op opaque.
    args = _valid_args()
    torch.library.opcheck(torch.ops.hpi_kernels.paged_attention_cpu.default, tuple(args.values()))


def test_available_and_built_for_torch_capability(extension) -> None:
    assert cpu_kernels_available()
    assert f"hpi_cpu_kernels_{cpu_capability().lower()}" in Path(extension).name
    if expected := os.environ.get("HPI_EXPECT_CPU_CAPABILITY"):  # set by the test below for its child run
        assert cpu_capability() == expected


def test_missing_compiler_is_reported_not_a_crash() -> None:
    code = (
        "import hpi_kernels.cpu as cpu\n"
        "assert cpu.cpu_kernels_available() is False\n"
        "try:\n"
        "    cpu.load_extension()\n"
        "except cpu.CpuKernelBuildError as error:\n"
        "    print(error)\n"
    )
    env = {**os.environ, "CXX": "/nonexistent/c++"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "needs a C++ compiler; '/nonexistent/c++' is not on PATH" in result.stdout


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load(extension) -> None:
    """cpp_extension's lock file outlives a build killed mid-way; a later load must not wait for it forever."""
    if not os.environ.get("HPI_CACHE_DIR"):
        pytest.skip("the leftover-lock guard covers the HPI_CACHE_DIR build directory")
    build_dir = Path(extension).parent
    (build_dir / "lock").touch()  # as a killed build leaves it
    code = "import hpi_kernels.cpu as cpu\nprint(cpu.load_extension())\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == extension, result.stderr[-2000:]
    assert not (build_dir / "lock").exists()  # removed (by this load, or by a worker loading beside it)



def _cached_step(num_rows: int = 5, num_tokens: int = 4):
    """A decode-and-prefill step whose new K/V are slices of one fused qkv tensor (as the model has them)."""
    generator = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 64, 16, 6
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    qkv = torch.randn(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q, k, v = (t.view(num_rows, -1, head_dim) for t in (q, k, v))
    block_tables = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32)
    # request 0: one decode token at position 20 (block 0 of its table is 3, block 1 is 0); request 1: 3
    # prefill tokens at positions 0..2 of block 5.
    slot_mapping = torch.tensor([0 * block_size + 4, 5 * block_size + 0, 5 * block_size + 1, 5 * block_size + 2])
    query_start_loc = torch.tensor([0, 1, 4], dtype=torch.int32)
    context_lens = torch.tensor([21, 3], dtype=torch.int32)
    return (q, k, v, k_cache, v_cache, slot_mapping[:num_tokens], block_tables, query_start_loc, context_lens, 0.125)


def test_cached_op_writes_the_new_rows_then_attends() -> None:
    """cached_paged_attention_cpu = the new K/V copied into their slots + paged_attention_cpu; the pad row
    (past slot_mapping) is zero and writes nothing."""
    args = _cached_step()
    q, k, v, k_cache, v_cache, slots, tables, starts, lens, scale = args
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, 2, 64)[slots] = k[:4]
    expected_v.view(-1, 2, 64)[slots] = v[:4]
    expected = torch.zeros(q.shape)
    paged_attention_ref(expected, q, expected_k, expected_v, tables, starts, lens, scale)
    out = torch.ops.hpi_kernels.cached_paged_attention_cpu(*args)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert not out[4:].any()
    torch.library.opcheck(torch.ops.hpi_kernels.cached_paged_attention_cpu.default, _cached_step())


@pytest.mark.parametrize("cache_dtype", FP8_CACHES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cached_op_writes_fp8_rows_rounded_and_saturated(cache_dtype, dtype) -> None:
    """Into an fp8 cache the new rows go as to_cache_dtype has them (clamped to the largest finite value, then
    rounded to nearest even: bit for bit torch's conversion), and attention reads them back."""
    q, k, v, k_cache, v_cache, *rest = _cached_step()
    k[1, 0, :3] = torch.tensor([1e6, -1e6, 500.0])  # past both formats' range (e5m2's top is 57344), past e4m3's
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    slots = rest[0]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for cache, rows in ((expected_k, k), (expected_v, v)):
        cache.view(torch.uint8).view(-1, 2, 64)[slots] = to_cache_dtype(rows[:4], cache_dtype).view(torch.uint8)
    expected = torch.zeros(q.shape, dtype=dtype)
    paged_attention_ref(expected, q, expected_k, expected_v, *rest[1:])
    out = torch.ops.hpi_kernels.cached_paged_attention_cpu(q, k, v, k_cache, v_cache, *rest)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    limit = torch.finfo(cache_dtype).max
    assert k_cache.view(-1, 2, 64)[slots[1], 0, :2].float().tolist() == [limit, -limit]
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_cached_op_writes_bf16_cache_rows_rounded_to_nearest_even(dtype) -> None:
    """Into a bf16 cache under a wider model, the new rows go as `.to(torch.bfloat16)` has them, ties to even, and
    attention reads them back."""
    q, k, v, k_cache, v_cache, *rest = _cached_step()
    k[1, 0, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3e4])  # halfway between bf16 neighbours: to the even one
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    slots = rest[0]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for cache, rows in ((expected_k, k), (expected_v, v)):
        cache.view(-1, 2, 64)[slots] = rows[:4].to(torch.bfloat16)
    expected = torch.zeros(q.shape, dtype=dtype)
    paged_attention_ref(expected, q, expected_k, expected_v, *rest[1:])
    out = torch.ops.hpi_kernels.cached_paged_attention_cpu(q, k, v, k_cache, v_cache, *rest)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert k_cache.view(-1, 2, 64)[slots[1], 0, :2].float().tolist() == [1.0, 1 + 2**-6]
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_a_cache_of_another_dtype_is_refused() -> None:
    q, k, v, k_cache, v_cache, *rest = _cached_step()
    with pytest.raises(ValueError, match="bfloat16, float8_e4m3fn or float8_e5m2"):
        torch.ops.hpi_kernels.cached_paged_attention_cpu(q, k, v, k_cache.half(), v_cache.half(), *rest)


@pytest.mark.parametrize(
    "index,value,message",
    [
        (5, torch.tensor([4, 80, 81, 96 * 16]), "outside the cache"),
        (5, torch.tensor([4, 80, 81, 82], dtype=torch.int32), "slot_mapping must be"),
        (1, torch.randn(5, 2, 32), "k and v must be"),
        (1, torch.randn(3, 2, 64), "k and v must be"),  # fewer rows than new tokens
    ],
)
def test_cached_op_bad_arguments_raise_value_error(index, value, message) -> None:
    args = list(_cached_step())
    args[index] = value
    if index == 1:
        args[2] = torch.randn(value.shape)
    with pytest.raises(ValueError, match=message):
        torch.ops.hpi_kernels.cached_paged_attention_cpu(*args)
