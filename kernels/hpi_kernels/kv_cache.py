"""KV-cache write: scatter this step's new key/value rows into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hpi_kernels._validate import CONVERTED_KV_DTYPES, check_device, check_dim, check_dtype, check_kv_cache, check_rank


@triton.jit
def _round_to_fp8_grid(x, MANTISSA: tl.constexpr, BIAS: tl.constexpr, LIMIT: tl.constexpr):
    """x (fp32) rounded to nearest even on the fp8 format's grid and clamped to +-LIMIT, still in fp32: the cast
    that follows is then exact. Written out because Triton's interpreter rounds wrong where the carry crosses a
    binade (-31.13 -> -16.0 in e4m3), and so the tests check the bits a GPU writes."""
    exponent = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.maximum(exponent, 128 - BIAS)  # subnormals: the smallest normal binade's spacing
    # 2^23 ulps: adding it to |x| leaves |x| rounded to a whole ulp (fp32 rounds to nearest even); the sign after,
    # so that what rounds to zero keeps it (-0.0, as torch's conversion has it).
    magic = ((exponent - MANTISSA + 23) << 23).to(tl.float32, bitcast=True)
    rounded = tl.minimum((tl.abs(x) + magic) - magic, LIMIT)
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def _round_to_bf16_grid(x):
    """x (fp32) rounded to nearest even on bf16's grid, still in fp32 (the cast that follows is then exact): the
    bits' low half rounded away in integers, as torch's conversion does (past bf16's largest value: inf; NaN kept).
    Written out because Triton's interpreter truncates instead, and so the tests check the bits a GPU writes."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64, -1 = skip
    stride_key_t, stride_key_h, stride_key_d,
    stride_value_t, stride_value_h, stride_value_d,
    stride_cache_block, stride_cache_tok, stride_cache_h, stride_cache_d,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,  # an fp8 cache's mantissa bits (0: a cache in the rows' dtype)
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,  # its largest finite value: larger values saturate
    BF16: tl.constexpr,  # a bf16 cache (rows of any dtype)
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
        key = tl.load(
            key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :] * stride_key_d,
            mask=mask,
        )
        value = tl.load(
            value_ptr + token * stride_value_t + heads[:, None] * stride_value_h
            + dims[None, :] * stride_value_d,
            mask=mask,
        )
        # int64 throughout: block_id * stride_cache_block overflows int32 for large caches.
        cache_offsets = (
            (slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_tok
            + heads[:, None].to(tl.int64) * stride_cache_h
            + dims[None, :] * stride_cache_d
        )
        key, value = key.to(tl.float32), value.to(tl.float32)  # exact; one type whichever branch runs
        if FP8_MANTISSA > 0:
            key = _round_to_fp8_grid(key, FP8_MANTISSA, FP8_BIAS, FP8_MAX)
            value = _round_to_fp8_grid(value, FP8_MANTISSA, FP8_BIAS, FP8_MAX)
        if BF16:
            key, value = _round_to_bf16_grid(key), _round_to_bf16_grid(value)
        tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64; slot = block_id * block_size + offset, -1 = skip
) -> None:
    """Scatters key/value rows into k_cache/v_cache at slot_mapping; padded tokens use slot -1. An fp8 cache
    gets the rows rounded to nearest even and saturated (no scale), as `.clamp(-max, max).to(fp8)` would; a bf16
    cache, as `.to(torch.bfloat16)`."""
    check_kv_cache(k_cache, v_cache)
    check_rank("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_rank("value", value, 3, "[num_tokens, num_kv_heads, head_dim]")
    if key.shape != value.shape:
        raise ValueError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    check_dim("key", key, 1, k_cache.shape[2], "the cache's num_kv_heads")
    check_dim("key", key, 2, k_cache.shape[3], "the cache's head_dim")
    if value.dtype != key.dtype or (key.dtype != k_cache.dtype and k_cache.dtype not in CONVERTED_KV_DTYPES):
        raise ValueError(f"key/value dtypes ({key.dtype}, {value.dtype}) must match the cache's {k_cache.dtype}")
    check_rank("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    check_dim("slot_mapping", slot_mapping, 0, key.shape[0], "key.shape[0]")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    check_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),  # 1-D index tensors: read with stride 1
        *key.stride(), *value.stride(), *k_cache.stride(),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **_cache_format(k_cache.dtype),
    )


def _cache_format(cache_dtype: torch.dtype) -> dict[str, float | bool]:
    """The write kernel's FP8_* constants (mantissa 0: not an fp8 cache) and BF16 for a cache of `cache_dtype`."""
    formats = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}
    mantissa, bias = formats.get(cache_dtype, (0, 0))
    limit = float(torch.finfo(cache_dtype).max) if mantissa else 0.0
    return {"FP8_MANTISSA": mantissa, "FP8_BIAS": bias, "FP8_MAX": limit, "BF16": cache_dtype == torch.bfloat16}
