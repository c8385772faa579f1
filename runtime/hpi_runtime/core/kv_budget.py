"""How many KV blocks a memory budget buys, with a clear error when one full-length request cannot fit."""

from __future__ import annotations


def num_blocks_for_budget(kv_cache_memory_bytes: int, bytes_per_token: int, block_size: int, max_model_len: int) -> int:
    for name, value in (
        ("kv_cache_memory_bytes", kv_cache_memory_bytes),
        ("bytes_per_token", bytes_per_token),
        ("block_size", block_size),
        ("max_model_len", max_model_len),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    bytes_per_block = bytes_per_token * block_size
    num_blocks = int(kv_cache_memory_bytes // bytes_per_block)
    num_blocks_needed = -(-max_model_len // block_size)
    if num_blocks < num_blocks_needed:
        raise ValueError(
            f"KV cache budget of {kv_cache_memory_bytes} bytes holds {num_blocks} blocks of {block_size} tokens "
            f"({bytes_per_block} bytes each, {num_blocks * block_size} tokens), but one request of "
            f"max_model_len={max_model_len} needs {num_blocks_needed} blocks "
            f"({num_blocks_needed * bytes_per_block} bytes); raise the KV memory budget or lower max_model_len"
        )
    return num_blocks


def kv_tokens_per_request(
    max_model_len: int, block_size: int, sliding_window: int | None = None, max_num_batched_tokens: int = 0
) -> int:
    """Token slots one request can hold at once: max_model_len, or under a sliding window on every layer
    (blocks behind it are freed) the window plus one step's chunk, plus the block boundaries on both sides
    and the manager's placeholder block."""
    if sliding_window is None:
        return max_model_len
    return min(max_model_len, sliding_window + max_num_batched_tokens + 2 * block_size) + block_size
