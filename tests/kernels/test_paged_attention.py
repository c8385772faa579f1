"""Paged decode attention (split-KV + reduction) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import paged_decode_attention
from hpi_kernels.paged_attention import choose_num_splits
from hpi_kernels.reference import paged_decode_attention_ref


def _query(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, non_contiguous: bool) -> torch.Tensor:
    batch, num_q_heads, head_dim = shape
    if non_contiguous:  # a slice of a fused QKV projection, as the model produces it
        qkv = torch.randn(batch, 2 * num_q_heads * head_dim).to(device, dtype)
        return qkv[:, : num_q_heads * head_dim].view(batch, num_q_heads, head_dim)
    return torch.randn(batch, num_q_heads, head_dim).to(device, dtype)


CASES = [
    # (num_q_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, non_contiguous)
    pytest.param(9, 3, 64, 16, torch.float32, 1, False, id="gqa9:3-d64-bs16-fp32-1split"),
    pytest.param(9, 3, 64, 16, torch.float16, 3, True, id="gqa9:3-d64-bs16-fp16-3splits-noncontig"),
    pytest.param(8, 1, 128, 32, torch.float32, 2, True, id="gqa8:1-d128-bs32-fp32-2splits-noncontig"),
    pytest.param(8, 1, 64, 16, torch.float16, 4, False, id="gqa8:1-d64-bs16-fp16-4splits"),
    pytest.param(4, 4, 64, 32, torch.float16, None, False, id="mha-d64-bs32-fp16-auto"),
    # bf16 runs upcast in the interpreter; head_dim 96 pads to a 128-wide tile.
    pytest.param(4, 2, 96, 16, torch.bfloat16, 2, False, id="gqa4:2-d96-bs16-bf16-2splits"),
]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size,dtype,num_splits,non_contiguous", CASES)
def test_decode_matches_reference(
    paged_cache, tol, device, num_q_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, non_contiguous
) -> None:
    torch.manual_seed(0)
    # Ragged: one token, exactly one block, one past a block boundary, several blocks and a partial one.
    context_lens = [1, block_size, block_size + 1, 3 * block_size + 5]
    cache = paged_cache(context_lens, num_kv_heads, head_dim, block_size, dtype, non_contiguous)
    query = _query((len(context_lens), num_q_heads, head_dim), dtype, device, non_contiguous)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale, num_splits
    )
    expected = paged_decode_attention_ref(
        query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, scale
    )
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **tol(dtype))


@pytest.mark.parametrize(
    ("cache_dtype", "dtype"),
    [(torch.float8_e4m3fn, torch.float32), (torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float32),
     (torch.float8_e5m2, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16)],
    ids=str,
)  # fmt: skip
def test_decode_reads_a_converted_cache(paged_cache, tol, device, cache_dtype, dtype) -> None:
    """`--kv-cache-dtype fp8*` and `bfloat16` (under an fp32 or fp16 model): K/V tiles widened to the query's dtype
    (fp16 over bf16: both to fp32) for tl.dot, against the reference over the same cached values."""
    context_lens = [1, 16, 17, 53]
    cache = paged_cache(context_lens, 3, 64, 16, cache_dtype)
    query = _query((len(context_lens), 9, 64), dtype, device, non_contiguous=False)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    out = paged_decode_attention(*args, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **tol(dtype))


def test_split_count_does_not_change_the_result(paged_cache, device) -> None:
    cache = paged_cache([7, 150], num_kv_heads=2, head_dim=64, block_size=16)
    query = torch.randn(2, 4, 64, device=device)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    one = paged_decode_attention(*args, num_splits=1)
    # 7 splits over 150 tokens in 64-token tiles: three splits hold work, four are empty for both requests.
    many = paged_decode_attention(*args, num_splits=7)
    torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_zero_context_gives_zeros_not_nan(paged_cache, device, num_splits) -> None:
    cache = paged_cache([5, 20], num_kv_heads=1, head_dim=64, block_size=16)
    context_lens = torch.tensor([0, 20], dtype=torch.int32, device=device)  # e.g. a padded batch row
    query = torch.randn(2, 2, 64, device=device)
    args = (query, cache.k_cache, cache.v_cache, cache.block_tables, context_lens, 0.125)
    out = paged_decode_attention(*args, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out[1]).all()


def test_choose_num_splits() -> None:
    assert choose_num_splits(num_programs=512, max_context_tokens=32768, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_context_tokens=32768, num_sms=132) == 33
    assert choose_num_splits(num_programs=8, max_context_tokens=1024, num_sms=132) == 2
    assert choose_num_splits(num_programs=1, max_context_tokens=10**6, num_sms=132) == 64
    assert choose_num_splits(num_programs=8, max_context_tokens=16, num_sms=132) == 1


def _args(paged_cache, **overrides):
    cache = paged_cache([5, 20], num_kv_heads=2, head_dim=64, block_size=16, device=torch.device("cpu"))
    args = {
        "query": torch.randn(2, 4, 64),
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "block_tables": cache.block_tables,
        "context_lens": cache.context_lens,
        "scale": 0.125,
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"query": torch.randn(2, 4)}, "query must be"),
        ({"query": torch.randn(2, 3, 64)}, "multiple of num_kv_heads"),
        ({"query": torch.randn(2, 4, 32)}, "head_dim"),
        ({"query": torch.randn(2, 4, 64).half()}, "dtype"),
        ({"block_tables": torch.zeros(2, 3, dtype=torch.int64)}, "block_tables must have dtype"),
        ({"block_tables": torch.zeros(3, 3, dtype=torch.int32)}, "block_tables.shape"),
        ({"context_lens": torch.tensor([5], dtype=torch.int32)}, "context_lens.shape"),
        ({"v_cache": torch.zeros(4, 16, 2, 32)}, "shapes differ"),
        ({"k_cache": torch.zeros(4, 16, 2)}, "k_cache must be"),
        ({"num_splits": 0}, "num_splits"),
    ],
)
def test_decode_validation(paged_cache, overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**_args(paged_cache, **overrides))


def test_decode_refuses_cpu_tensors_without_the_interpreter(paged_cache, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        paged_decode_attention(**_args(paged_cache))
