"""Perplexity of a loaded model on a fixed text: one prefill through the model's own paged attention path.

Used to measure what quantization costs in quality (tests and bench/bench_quantization.py). The model
gets a private KV cache just big enough for the text, so it must not be one an engine is serving from.
"""

from __future__ import annotations

import math

import torch

from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.attention.metadata import AttentionMetadata
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.worker.model_runner import KVCacheSpec, allocate_kv_caches

BLOCK_SIZE = 16


@torch.inference_mode()
def perplexity(model: DecoderForCausalLM, backend: AttentionBackend, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of token i + 1 given tokens 0..i), over the whole sequence."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    device = next(model.parameters()).device
    dtype = model.model.norm.weight.dtype
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    allocate_kv_caches(model, KVCacheSpec(num_blocks, BLOCK_SIZE, dtype), device)
    common = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        num_decode_reqs=0,
        max_query_len=num_tokens,
        max_context_len=num_tokens,
        block_size=BLOCK_SIZE,
    )
    ids = torch.tensor(token_ids, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), backend.build_metadata(common))
    logits = model.compute_logits(hidden[:-1])  # [num_tokens - 1, vocab] fp32
    nll = torch.nn.functional.cross_entropy(logits, ids[1:])
    return math.exp(nll.item())
