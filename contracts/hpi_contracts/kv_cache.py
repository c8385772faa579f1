"""The paged KV cache's shape as the runtime allocates it and the operator sizes it: the block sizes the
runtime accepts and the bytes one token's K and V take. The operator has no torch, so it cannot ask the
runtime; both import this instead."""

from __future__ import annotations

# Tokens per KV block the runtime accepts (`hpi serve --block-size`, the CRD's spec.engine.blockSize enum):
# powers of two, so a block index is a shift and the Triton kernels' tiles divide it.
BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token across `num_layers` layers of `num_kv_heads` heads each."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes
