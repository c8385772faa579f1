"""The paged KV cache's shape as the runtime allocates it and the operator sizes it: the block sizes the
runtime accepts and the bytes one token's K and V take. The operator has no torch, so it cannot ask the
runtime; both import this instead."""

from __future__ import annotations

# Tokens per KV block the runtime accepts (`hpi serve --block-size`, the CRD's spec.engine.blockSize enum):
# powers of two, so a block index is a shift and the Triton kernels' tiles divide it.
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)

# KV cache element types (`hpi serve --kv-cache-dtype`, vLLM's names; the CRD's spec.engine.kvCacheDtype enum):
# "auto" is the model's dtype; "bfloat16" two bytes per element whatever the model's dtype (half an fp32 model's);
# "fp8" is fp8_e4m3 (e4m3fn), one byte per element like fp8_e5m2.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes per cached K or V element: the model dtype's for "auto", two for bfloat16, one for the fp8 types."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    return {"auto": model_dtype_bytes, "bfloat16": 2}.get(kv_cache_dtype, 1)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token across `num_layers` layers of `num_kv_heads` heads each."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes
