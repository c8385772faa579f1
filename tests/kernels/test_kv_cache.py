"""KV-cache write (scatter into slots) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import write_kv_cache
from hpi_kernels.reference import write_kv_cache_ref


@pytest.mark.parametrize(
    "num_kv_heads,head_dim,block_size,dtype,non_contiguous",
    [
        pytest.param(3, 64, 16, torch.float32, False, id="h3-d64-bs16-fp32"),
        pytest.param(1, 128, 32, torch.float16, True, id="h1-d128-bs32-fp16-noncontig"),
        pytest.param(2, 64, 32, torch.bfloat16, True, id="h2-d64-bs32-bf16-noncontig"),  # copies only: bf16 ok
    ],
)
def test_write_matches_reference(
    paged_cache, device, num_kv_heads, head_dim, block_size, dtype, non_contiguous
) -> None:
    cache = paged_cache([3 * block_size], num_kv_heads, head_dim, block_size, dtype, non_contiguous)
    num_blocks = cache.k_cache.shape[0]
    # First and last slot of a block, the cache's very last slot, and padding (-1) in between.
    slots = [0, block_size - 1, block_size, -1, 2 * block_size + 3, num_blocks * block_size - 1, -1]
    num_tokens = len(slots)
    if non_contiguous:  # K and V as slices of a fused QKV projection
        qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim).to(device, dtype)
        key, value = qkv[:, 1], qkv[:, 2]
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim).to(device, dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_dim).to(device, dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    k_expected, v_expected = cache.k_cache.clone(), cache.v_cache.clone()
    write_kv_cache_ref(key, value, k_expected, v_expected, slot_mapping)
    write_kv_cache(key, value, cache.k_cache, cache.v_cache, slot_mapping)
    assert torch.equal(cache.k_cache, k_expected)
    assert torch.equal(cache.v_cache, v_expected)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_into_an_fp8_cache_rounds_and_saturates(paged_cache, device, cache_dtype, dtype) -> None:
    """The reference's to_cache_dtype exactly: clamped to the format's largest finite value, rounded to nearest
    even (subnormals included); values past the range saturate instead of becoming NaN."""
    cache = paged_cache([32], 2, 64, 16, cache_dtype)
    key = (torch.randn(3, 2, 64) * torch.logspace(-4, 2, 64)).to(device, dtype)  # subnormals to e4m3's top
    key[0, 0, :2] = torch.tensor([1e6, -1e6])
    value = torch.randn(3, 2, 64).to(device, dtype)
    slot_mapping = torch.tensor([5, -1, 31], dtype=torch.int64, device=device)
    k_expected, v_expected = cache.k_cache.clone(), cache.v_cache.clone()
    write_kv_cache_ref(key, value, k_expected, v_expected, slot_mapping)
    write_kv_cache(key, value, cache.k_cache, cache.v_cache, slot_mapping)
    # Values, not bits: Triton's interpreter casts -0.0 to +0.0 (a GPU keeps the sign); every other value is exact.
    assert torch.equal(cache.k_cache.float(), k_expected.float())
    assert torch.equal(cache.v_cache.float(), v_expected.float())
    limit = torch.finfo(cache_dtype).max
    assert cache.k_cache.view(-1, 2, 64)[5, 0, :2].float().tolist() == [limit, -limit]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_write_into_a_bf16_cache_rounds_to_nearest_even(paged_cache, device, dtype) -> None:
    """`--kv-cache-dtype bfloat16` under a wider model: the rows as `.to(torch.bfloat16)` has them, ties to even."""
    cache = paged_cache([32], 2, 64, 16, torch.bfloat16)
    key = torch.randn(3, 2, 64).to(device, dtype)
    key[0, 0, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38])  # halfway between bf16 neighbours; past its top
    value = torch.randn(3, 2, 64).to(device, dtype)
    slot_mapping = torch.tensor([5, -1, 31], dtype=torch.int64, device=device)
    k_expected, v_expected = cache.k_cache.clone(), cache.v_cache.clone()
    write_kv_cache_ref(key, value, k_expected, v_expected, slot_mapping)
    write_kv_cache(key, value, cache.k_cache, cache.v_cache, slot_mapping)
    assert torch.equal(cache.k_cache, k_expected) and torch.equal(cache.v_cache, v_expected)
    assert cache.k_cache.view(-1, 2, 64)[5, 0, :3].float().tolist() == [1.0, 1 + 2**-6, float("inf")]


def test_write_of_no_tokens_is_a_no_op(paged_cache, device) -> None:
    cache = paged_cache([4], 2, 64, 16)
    before = cache.k_cache.clone()
    empty = torch.empty(0, 2, 64, device=device)
    write_kv_cache(empty, empty, cache.k_cache, cache.v_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(cache.k_cache, before)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"slot_mapping": torch.zeros(4, dtype=torch.int32)}, "slot_mapping must have dtype"),
        ({"slot_mapping": torch.zeros(3, dtype=torch.int64)}, "slot_mapping.shape"),
        ({"key": torch.randn(4, 3, 64), "value": torch.randn(4, 3, 64)}, "key.shape\\[1\\]"),
        ({"key": torch.randn(4, 2, 64).half()}, "dtypes"),
        ({"value": torch.randn(4, 2, 32)}, "shapes differ"),
    ],
)
def test_write_validation(paged_cache, overrides, message) -> None:
    cache = paged_cache([4], 2, 64, 16, device=torch.device("cpu"))
    args = {
        "key": torch.randn(4, 2, 64),
        "value": torch.randn(4, 2, 64),
        "k_cache": cache.k_cache,
        "v_cache": cache.v_cache,
        "slot_mapping": torch.zeros(4, dtype=torch.int64),
    }
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        write_kv_cache(**args)
