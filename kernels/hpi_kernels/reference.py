"""Plain-PyTorch references for every kernel: slow, obvious, fp32 math; the tests' ground truth."""

from __future__ import annotations

import torch

from hpi_kernels._validate import FP8_KV_DTYPES
from hpi_kernels.quant import dequantize_int4, dequantize_int8


def to_cache_dtype(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K/V rows as a cache of `cache_dtype` stores them: as they are, or, for an fp8 cache, saturated at the
    format's largest finite value and rounded to nearest even, unscaled (vLLM's default k/v scale of 1.0)."""
    if cache_dtype in FP8_KV_DTYPES:
        limit = torch.finfo(cache_dtype).max
        return rows.clamp(-limit, limit).to(cache_dtype)
    return rows.to(cache_dtype)


def byte_view(cache: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or for an fp8 one its bytes (same shape): what copies of whole elements go through,
    since torch's CPU index_copy_ has no fp8 kernel."""
    return cache.view(torch.uint8) if cache.dtype in FP8_KV_DTYPES else cache


def write_kv_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(key[keep], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(value[keep], v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks]
    context_len: int,
) -> torch.Tensor:  # [context_len, Hkv, D]
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:context_len]


def _attend(
    query: torch.Tensor,  # [Q, Hq, D]
    key: torch.Tensor,  # [S, Hkv, D]
    value: torch.Tensor,  # [S, Hkv, D]
    query_positions: torch.Tensor,  # [Q] position of each query token among the S keys
    scale: float,
    sliding_window: int | None = None,  # a query at p sees keys p - window + 1 .. p only
    logit_softcap: float | None = None,  # scores -> cap * tanh(scores / cap) before the mask
) -> torch.Tensor:  # [Q, Hq, D] fp32
    group_size = query.shape[1] // key.shape[1]
    key = key.float().repeat_interleave(group_size, dim=1)
    value = value.float().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,shd->hqs", query.float(), key) * scale
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    key_positions = torch.arange(key.shape[0], device=key.device)[None, :]
    hidden = key_positions > query_positions[:, None]
    if sliding_window is not None:
        hidden |= key_positions <= query_positions[:, None] - sliding_window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(dim=-1), value)


def paged_decode_attention_ref(
    query: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    out = torch.empty_like(query)
    for b, context_len in enumerate(context_lens.tolist()):
        key = gather_kv(k_cache, block_tables[b], context_len)
        value = gather_kv(v_cache, block_tables[b], context_len)
        positions = torch.tensor([context_len - 1], device=query.device)
        attended = _attend(query[b : b + 1], key, value, positions, scale, sliding_window, logit_softcap)
        out[b] = attended[0].to(query.dtype)
    return out


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, total tokens per request including this step's
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for b, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue
        key = gather_kv(k_cache, block_tables[b], context_len)
        value = gather_kv(v_cache, block_tables[b], context_len)
        positions = torch.arange(context_len - (q_end - q_start), context_len, device=query.device)
        attended = _attend(query[q_start:q_end], key, value, positions, scale, sliding_window, logit_softcap)
        out[q_start:q_end] = attended.to(query.dtype)
    return out


def int8_weight_only_matmul_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
) -> torch.Tensor:  # [M, N]
    return (x.float() @ dequantize_int8(weight, scales).T).to(x.dtype)


def int4_weight_only_matmul_ref(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # [N, K // 2] uint8
    scales: torch.Tensor,  # [N, K // group_size]
    zeros: torch.Tensor,  # [N, K // group_size]
    group_size: int,
) -> torch.Tensor:  # [M, N]
    return (x.float() @ dequantize_int4(packed, scales, zeros, group_size).T).to(x.dtype)


def fused_experts_ref(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # [T, top_k]
) -> torch.Tensor:  # [T, H]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        x = hidden[t].float()
        for weight, expert in zip(topk_weights[t].tolist(), topk_ids[t].tolist(), strict=True):
            gate, up = (w13[expert].float() @ x).chunk(2)
            out[t] += weight * (w2[expert].float() @ (torch.nn.functional.silu(gate) * up))
    return out.to(hidden.dtype)


def lora_bgmv_ref(
    x: torch.Tensor,  # [T, K]
    weights: torch.Tensor,  # [S, N, K]
    slot_ids: torch.Tensor,  # [T], -1: none
    out: torch.Tensor,  # [T, N]
    accumulate: bool = False,
) -> torch.Tensor:
    """lora_bgmv's reference, token by token in fp32 (rows with slot -1 keep `out`'s values)."""
    result = out.clone()
    for t, slot in enumerate(slot_ids.tolist()):
        if slot < 0:
            continue
        row = weights[slot].float() @ x[t].float()
        result[t] = (row + out[t].float() if accumulate else row).to(out.dtype)
    return result
