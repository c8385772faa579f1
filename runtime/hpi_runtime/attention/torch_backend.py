"""The reference attention backend: gather the paged K/V and run one masked SDPA per group of requests.

It is the `torch` backend's fallback where hpi_kernels' C++ kernel does not serve a layer (op.py) and the
reference every other backend is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from hpi_kernels.reference import byte_view, to_cache_dtype
from hpi_runtime.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class _PaddedGroup:
    """Prefill/extend chunks attended together by one masked SDPA call, padded to common query/context lengths."""

    query_index: torch.Tensor  # [num_reqs, max_query_len] int64 -> flat token row (pads repeat a valid row)
    key_slots: torch.Tensor  # [num_reqs, max_context_len] int64 -> cache slot (pads point at slot 0)
    mask: torch.Tensor  # [num_reqs, 1, max_query_len, max_context_len] additive: 0 = attend, -inf = not
    token_rows: torch.Tensor  # [num_group_tokens] int64 -> row in the flattened padded output
    token_start: int  # first flat token of the group
    num_tokens: int


@dataclass(frozen=True)
class _DecodeGroup:
    """Decodes of similar context length attended by one masked SDPA call, padded to the longest of them."""

    query_rows: torch.Tensor  # [num_reqs] int64 -> flat token row of each request's one query (not contiguous)
    key_slots: torch.Tensor  # [num_reqs, max_context_len] int64 -> cache slot (pads point at slot 0)
    mask: torch.Tensor  # [num_reqs, 1, 1, max_context_len] additive: 0 = attend, -inf = not


@dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    decode_groups: tuple[_DecodeGroup, ...] = ()
    prefill_group: _PaddedGroup | None = None


def split_decodes_by_context_len(
    context_lens: torch.Tensor,  # [num_decode_reqs] int, on the host
    max_groups: int,
    group_cost_slots: int,
) -> tuple[torch.Tensor, ...]:  # each [num_group_reqs] int64 request indices; together a partition
    """Cut decodes into at most `max_groups` groups of consecutive context lengths that minimize
    padded key slots + `group_cost_slots` per group.

    A group costs its gather and SDPA over num_reqs * max_context_len slots plus a fixed per-call overhead
    (priced in slots), so one group stays when the batch is uniform or too small for a split to pay.
    Exact dynamic programme over the sorted lengths; O(max_groups * n^2) tensor work, n = number of decodes.
    """
    n = context_lens.shape[0]
    lens = context_lens.to(torch.float64)
    if n == 0 or max_groups <= 1 or float(n * lens.max() - lens.sum()) <= group_cost_slots:
        return (torch.arange(n),) if n else ()
    lens, order = lens.sort()
    bounds = torch.arange(n + 1)
    # cost[m, i]: padded slots of one group holding sorted requests [m, i); inf unless m < i.
    width = (bounds[None, :] - bounds[:, None]).to(torch.float64)
    cost = torch.where(width > 0, width * torch.cat([lens[:1], lens])[None, :], torch.inf)
    best = cost[0]  # best[i]: fewest padded slots covering the i shortest requests with k groups
    best_total, best_k, starts = float(best[n]) + group_cost_slots, 1, []
    for k in range(2, min(max_groups, n) + 1):
        best, start = (best[:, None] + cost).min(0)
        starts.append(start)
        if float(best[n]) + k * group_cost_slots < best_total:
            best_total, best_k = float(best[n]) + k * group_cost_slots, k
    groups, end = [], n
    for start in reversed(starts[: best_k - 1]):
        first = int(start[end])
        groups.append(order[first:end])
        end = first
    groups.append(order[:end])
    return tuple(reversed(groups))


def _key_slots(
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int64
    block_size: int,
    width: int,
    first_positions: torch.Tensor | None = None,  # [num_reqs] int64: position of column 0 (default 0)
) -> torch.Tensor:  # [num_reqs, width] int64
    """Cache slot of context positions first_positions[r] + j (columns past a table's end repeat its last block)."""
    positions = torch.arange(width, device=block_tables.device).expand(block_tables.shape[0], -1)
    if first_positions is not None:
        positions = positions + first_positions[:, None]
    block_ids = block_tables.gather(1, (positions // block_size).clamp_max(block_tables.shape[1] - 1))
    return block_ids * block_size + positions % block_size


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Additive, in the model's dtype: SDPA would otherwise convert a bool mask in every layer.
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _build_decode_group(
    common: AttentionMetadata, req_ids: torch.Tensor, mask_dtype: torch.dtype, window: int | None = None
) -> _DecodeGroup:
    """Gather indices and length mask for the decode requests `req_ids` ([num_reqs] int64); with a sliding
    `window`, only the last `window` positions of each context are gathered."""
    req_ids = req_ids.to(common.context_lens.device)
    context_lens = common.context_lens.index_select(0, req_ids).long()
    first_positions = None if window is None else (context_lens - window).clamp_min(0)
    num_keys = context_lens if first_positions is None else context_lens - first_positions
    width = int(num_keys.max())
    cols = torch.arange(width, device=req_ids.device)
    block_tables = common.block_tables.index_select(0, req_ids).long()
    return _DecodeGroup(
        query_rows=common.query_start_loc.index_select(0, req_ids).long(),
        key_slots=_key_slots(block_tables, common.block_size, width, first_positions),
        mask=_additive(cols[None, :] < num_keys[:, None], mask_dtype)[:, None, None, :],
    )


def _build_group(
    common: AttentionMetadata, first: int, last: int, mask_dtype: torch.dtype, window: int | None = None
) -> _PaddedGroup:
    """Padded gather indices and causal (and sliding-window) mask for requests [first, last)."""
    device = common.context_lens.device
    loc = common.query_start_loc[first : last + 1].long()
    query_lens = loc[1:] - loc[:-1]
    context_lens = common.context_lens[first:last].long()
    max_query_len = int(query_lens.max())
    rows = torch.arange(max_query_len, device=device)
    query_index = torch.minimum(loc[:-1, None] + rows, loc[1:, None] - 1)
    # Query i of a request sits at position context_len - query_len + i and sees keys up to there (and
    # after its window's start). Pad rows (i >= query_len) act as the last query, so no row is fully masked.
    query_pos = torch.minimum((context_lens - query_lens)[:, None] + rows, context_lens[:, None] - 1)  # [R, Lq]
    # Keys are gathered from the first query's window start on (position 0 without a window).
    first_positions = torch.zeros_like(context_lens)
    if window is not None:
        first_positions = (context_lens - query_lens - window + 1).clamp_min(0)
    width = int((context_lens - first_positions).max())
    key_slots = _key_slots(common.block_tables[first:last].long(), common.block_size, width, first_positions)
    key_pos = (first_positions[:, None] + torch.arange(width, device=device))[:, None, :]  # [R, 1, Lk]
    mask = (key_pos <= query_pos[:, :, None]) & (key_pos < context_lens[:, None, None])
    if window is not None:
        mask &= key_pos > query_pos[:, :, None] - window
    token_req = torch.repeat_interleave(torch.arange(last - first, device=device), query_lens)
    token_offsets = torch.arange(token_req.shape[0], device=device) - (loc[token_req] - loc[0])
    token_rows = token_req * max_query_len + token_offsets
    return _PaddedGroup(
        query_index=query_index,
        key_slots=key_slots,
        mask=_additive(mask, mask_dtype).unsqueeze(1),
        token_rows=token_rows,
        token_start=int(loc[0]),
        num_tokens=int(loc[-1] - loc[0]),
    )


def _attend(
    q: torch.Tensor,  # [R, H_kv, rows, D]
    keys: torch.Tensor,  # [R, H_kv, Lk, D]
    values: torch.Tensor,  # [R, H_kv, Lk, D]
    mask: torch.Tensor,  # additive, broadcast to [R, H_kv, rows, Lk]
    scale: float,
    logit_softcap: float | None,
) -> torch.Tensor:  # [R, H_kv, rows, D]
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    # SDPA has no soft-cap: scores in fp32, capped, masked, softmaxed.
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logit_softcap) * logit_softcap + mask
    return torch.matmul(scores.softmax(dim=-1), values.float()).to(q.dtype)


class TorchAttentionBackend:
    """Reference and CPU backend: gathers paged K/V and runs one batched masked SDPA per group per layer.

    Decodes and prefill chunks form separate groups so that one long prompt does not pad every decode
    to its length; decodes are further bucketed by context length (`split_decodes_by_context_len`) so that
    a few long contexts do not pad every short one. Both the gather and SDPA cost scale with padded slots.
    """

    name = "torch"

    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        max_decode_groups: int = 8,
        # ~0.1 ms of fixed work per group and layer, priced at the per-slot cost of 64 decodes on 2 AVX2 cores
        # (bench/bench_attention_cpu.py); 128 and 512 measured the same there.
        group_cost_slots: int = 256,
    ) -> None:
        if max_decode_groups < 1:
            raise ValueError(f"max_decode_groups must be >= 1, got {max_decode_groups}")
        self.dtype = dtype  # the model's dtype (of q, k, v)
        self.max_decode_groups = max_decode_groups
        self.group_cost_slots = group_cost_slots

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        num_decodes = common.num_decode_reqs
        decode_req_ids = split_decodes_by_context_len(
            common.context_lens[:num_decodes].cpu(), self.max_decode_groups, self.group_cost_slots
        )
        decode_groups = tuple(_build_decode_group(common, ids, self.dtype) for ids in decode_req_ids)
        prefill_group = None
        if common.num_reqs > num_decodes:
            prefill_group = _build_group(common, num_decodes, common.num_reqs, self.dtype)
        fields = {f: getattr(common, f) for f in AttentionMetadata.__dataclass_fields__}
        return TorchAttentionMetadata(**fields, decode_groups=decode_groups, prefill_group=prefill_group)

    def _windowed(self, metadata: TorchAttentionMetadata, window: int) -> TorchAttentionMetadata:
        """The step's groups gathering only each query's window (built per sliding-window layer: cheap index
        math, and this backend is the reference; the C++ and Triton kernels skip the blocks themselves)."""
        num_decodes = metadata.num_decode_reqs
        decode_groups = ()
        if num_decodes:
            ids = torch.arange(num_decodes)
            decode_groups = (_build_decode_group(metadata, ids, self.dtype, window),)
        prefill_group = None
        if metadata.num_reqs > num_decodes:
            prefill_group = _build_group(metadata, num_decodes, metadata.num_reqs, self.dtype, window)
        return replace(metadata, decode_groups=decode_groups, prefill_group=prefill_group)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchAttentionMetadata), "metadata not built by TorchAttentionBackend"
        if sliding_window is not None:
            metadata = self._windowed(metadata, sliding_window)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, H_kv, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        for flat, rows in ((k_flat, k), (v_flat, v)):
            byte_view(flat).index_copy_(0, metadata.slot_mapping, byte_view(to_cache_dtype(rows, flat.dtype)))
        num_heads = q.shape[1]
        group_size = num_heads // num_kv_heads
        out = q.new_empty(q.shape)  # contiguous even when q is a view

        def gather(
            key_slots: torch.Tensor,  # [R, Lk] int64 cache slots
        ) -> tuple[torch.Tensor, torch.Tensor]:  # keys and values, each [R, H_kv, Lk, D]
            # index_select, not advanced indexing: the latter is ~100x slower for these sizes on CPU.
            num_reqs, slots = key_slots.shape[0], key_slots.view(-1)
            keys = k_flat.index_select(0, slots).to(q.dtype).view(num_reqs, -1, num_kv_heads, head_dim).transpose(1, 2)
            values = v_flat.index_select(0, slots).to(q.dtype).view(num_reqs, -1, num_kv_heads, head_dim)
            values = values.transpose(1, 2)
            return keys, values

        for group in metadata.decode_groups:
            # One query row per request and no padding of q: the mask broadcasts over a kv head's q heads.
            num_reqs = group.query_rows.shape[0]
            keys, values = gather(group.key_slots)
            q_dec = q.index_select(0, group.query_rows).view(num_reqs, num_kv_heads, group_size, head_dim)
            o = _attend(q_dec, keys, values, group.mask, scale, logit_softcap)
            out.index_copy_(0, group.query_rows, o.view(num_reqs, num_heads, head_dim))
        if (group := metadata.prefill_group) is not None:
            num_reqs, max_query_len = group.query_index.shape
            keys, values = gather(group.key_slots)
            # Fold the q heads sharing a kv head into the query axis: [R, H_kv, G * Lq, D], no K/V repeat.
            q_pad = q.index_select(0, group.query_index.view(-1))
            q_pad = q_pad.view(num_reqs, max_query_len, num_kv_heads, group_size, head_dim)
            q_pad = q_pad.permute(0, 2, 3, 1, 4).reshape(num_reqs, num_kv_heads, group_size * max_query_len, head_dim)
            mask = group.mask.expand(-1, group_size, -1, -1).reshape(num_reqs, 1, group_size * max_query_len, -1)
            o = _attend(q_pad, keys, values, mask, scale, logit_softcap)
            o = o.view(num_reqs, num_kv_heads, group_size, max_query_len, head_dim).permute(0, 3, 1, 2, 4)
            o = o.reshape(num_reqs * max_query_len, num_heads, head_dim)
            out[group.token_start : group.token_start + group.num_tokens] = o.index_select(0, group.token_rows)
        return out
