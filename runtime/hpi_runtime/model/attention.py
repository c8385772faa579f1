"""Paged attention: the metadata the model runner builds once per step and the backend interface.

KV cache layout (shared with the hpi_kernels Triton kernels): per layer `k_cache` and `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; token slot = block_id * block_size + offset.

The runner orders each step's requests decodes first (query length 1), then prefill/extend chunks, so a
backend can treat the two groups with different kernels. A backend turns the common metadata into its
own (`build_metadata`, once per step) and then runs every layer with it (`forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


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


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        """Once per step: precompute whatever every layer reuses (returns a subclass instance)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v into their slots, then attend each query over its request's cached context.

        q, k and v may be strided views (slices of the fused qkv projection); the caches are contiguous.
        """
        ...


@dataclass(frozen=True)
class _PaddedGroup:
    """Requests attended together by one masked SDPA call, padded to common query/context lengths."""

    query_index: torch.Tensor  # [num_reqs, max_query_len] int64 -> flat token row (pads repeat a valid row)
    key_slots: torch.Tensor  # [num_reqs, max_context_len] int64 -> cache slot (pads point at slot 0)
    mask: torch.Tensor  # [num_reqs, 1, max_query_len, max_context_len] additive: 0 = attend, -inf = not
    token_rows: torch.Tensor  # [num_group_tokens] int64 -> row in the flattened padded output
    token_start: int  # first flat token of the group
    num_tokens: int


@dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    groups: tuple[_PaddedGroup, ...] = ()


def _build_group(common: AttentionMetadata, first: int, last: int, mask_dtype: torch.dtype) -> _PaddedGroup:
    """Padded gather indices and causal mask for requests [first, last)."""
    device = common.context_lens.device
    loc = common.query_start_loc[first : last + 1].long()
    query_lens = loc[1:] - loc[:-1]
    context_lens = common.context_lens[first:last].long()
    max_query_len = int(query_lens.max())
    max_context_len = int(context_lens.max())
    rows = torch.arange(max_query_len, device=device)
    query_index = torch.minimum(loc[:-1, None] + rows, loc[1:, None] - 1)
    cols = torch.arange(max_context_len, device=device)
    block_tables = common.block_tables[first:last].long()
    block_ids = block_tables.gather(
        1, (cols // common.block_size).clamp_max(block_tables.shape[1] - 1).expand(last - first, -1)
    )
    key_slots = block_ids * common.block_size + cols % common.block_size
    # Query i of a request sits at position context_len - query_len + i and sees keys up to there.
    # Pad rows (i >= query_len) see every real key, so no row is fully masked (no NaN).
    query_pos = (context_lens - query_lens)[:, None] + rows  # [R, Lq]
    mask = (cols[None, None, :] <= query_pos[:, :, None]) & (cols[None, None, :] < context_lens[:, None, None])
    token_req = torch.repeat_interleave(torch.arange(last - first, device=device), query_lens)
    token_offsets = torch.arange(token_req.shape[0], device=device) - (loc[token_req] - loc[0])
    token_rows = token_req * max_query_len + token_offsets
    return _PaddedGroup(
        query_index=query_index,
        key_slots=key_slots,
        # Additive, in the model's dtype: SDPA would otherwise convert a bool mask in every layer.
        mask=torch.zeros(mask.shape, dtype=mask_dtype, device=device).masked_fill_(~mask, float("-inf")).unsqueeze(1),
        token_rows=token_rows,
        token_start=int(loc[0]),
        num_tokens=int(loc[-1] - loc[0]),
    )


class TorchAttentionBackend:
    """Reference and CPU backend: gathers paged K/V and runs one batched masked SDPA per group per layer.

    Decodes and prefill chunks form separate groups so that one long prompt does not pad every decode
    to its length.
    """

    name = "torch"

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype  # the model's dtype (of q, k, v)

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        bounds = [0, common.num_decode_reqs, common.num_reqs]
        groups = tuple(_build_group(common, a, b, self.dtype) for a, b in pairwise(bounds) if b > a)
        fields = {f: getattr(common, f) for f in AttentionMetadata.__dataclass_fields__}
        return TorchAttentionMetadata(**fields, groups=groups)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchAttentionMetadata), "metadata not built by TorchAttentionBackend"
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, H_kv, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, metadata.slot_mapping, k)
        v_flat.index_copy_(0, metadata.slot_mapping, v)
        num_heads = q.shape[1]
        group_size = num_heads // num_kv_heads
        out = q.new_empty(q.shape)  # contiguous even when q is a view
        for group in metadata.groups:
            num_reqs, max_query_len = group.query_index.shape
            # index_select, not advanced indexing: the latter is ~100x slower for these sizes on CPU.
            slots = group.key_slots.view(-1)
            keys = k_flat.index_select(0, slots).view(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
            values = v_flat.index_select(0, slots).view(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
            end = group.token_start + group.num_tokens
            if max_query_len == 1:  # decodes: no padding, the mask broadcasts over the q heads of a kv head
                q_dec = q[group.token_start : end].view(num_reqs, num_kv_heads, group_size, head_dim)
                o = F.scaled_dot_product_attention(q_dec, keys, values, attn_mask=group.mask, scale=scale)
                out[group.token_start : end] = o.view(num_reqs, num_heads, head_dim)
                continue
            # Fold the q heads sharing a kv head into the query axis: [R, H_kv, G * Lq, D], no K/V repeat.
            q_pad = q.index_select(0, group.query_index.view(-1))
            q_pad = q_pad.view(num_reqs, max_query_len, num_kv_heads, group_size, head_dim)
            q_pad = q_pad.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group_size * max_query_len, head_dim)
            mask = group.mask.expand(-1, group_size, -1, -1).reshape(num_reqs, 1, group_size * max_query_len, -1)
            o = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask, scale=scale)
            o = o.view(num_reqs, num_kv_heads, group_size, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
            o = o.reshape(num_reqs * max_query_len, num_heads, head_dim)
            out[group.token_start : end] = o.index_select(0, group.token_rows)
        return out


def get_attention_backend(name: str, dtype: torch.dtype) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend(dtype)
    if name == "triton":
        from hpi_runtime.model.triton_backend import TritonAttentionBackend  # imports triton: only when asked

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")


class Attention(nn.Module):
    """One layer's paged attention; the runner binds the layer's cache tensors after allocating them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, num_kv_heads, head_dim] once bound
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, metadata, self.scale)
