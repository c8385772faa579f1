"""The attention metadata the model runner builds once per step, common to every backend.

KV cache layout (shared with the hpi_kernels Triton kernels): per layer `k_cache` and `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; token slot = block_id * block_size + offset.

The runner orders each step's requests decodes first (query length 1), then prefill/extend chunks, so a
backend can treat the two groups with different kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: request r's tokens are [loc[r], loc[r + 1])
    context_lens: torch.Tensor  # [num_reqs] int32: tokens in the cache after this step, incl. the new ones
    num_decode_reqs: int  # requests [0, num_decode_reqs) have exactly one new token
    max_query_len: int
    max_context_len: int
    block_size: int

    @property
    def num_reqs(self) -> int:
        return self.context_lens.shape[0]
