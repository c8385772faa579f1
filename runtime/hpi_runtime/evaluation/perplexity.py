"""Perplexity of a loaded model on a fixed text: one prefill through the model's own paged attention path.

Used to measure what quantization costs in quality (tests and bench/bench_quantization.py). The model
gets a private KV cache just big enough for the text, so it must not be one an engine is serving from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.attention.metadata import AttentionMetadata
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.worker.model_runner import KVCacheSpec, allocate_kv_caches

BLOCK_SIZE = 16


@torch.inference_mode()
def perplexity(model: DecoderForCausalLM, backend: AttentionBackend, token_ids: list[int],
               chunk_size: int | None = None, kv_cache_dtype: torch.dtype | None = None) -> float:  # fmt: skip
    """exp(mean negative log-likelihood of token i + 1 given tokens 0..i), over the whole sequence.

    chunk_size: prefill the text in chunks of that many tokens (each attending to the ones before, as chunked
    prefill does) instead of in one pass: with chunks of decode-sized row counts the linears run the kernels
    decode steps run (on CPU, the quantized panels' tiles rather than the dequantized GEMM a long prefill
    takes), so that what those kernels change (int4's int8 activations) shows in the number.

    kv_cache_dtype: the private cache's element type (an fp8 type for `--kv-cache-dtype fp8*`); None: the
    model's dtype. Every query reads its keys and values back from that cache, the text's own included."""
    nll = 0.0  # a Python float: the chunks' sums may come from a GPU
    for logits, targets in _chunk_logits(model, backend, token_ids, chunk_size, kv_cache_dtype):
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
    return math.exp(nll / (len(token_ids) - 1))


@torch.inference_mode()
def next_token_logprobs(model: DecoderForCausalLM, backend: AttentionBackend, token_ids: list[int],
                        chunk_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """[len(token_ids) - 1, vocab] fp32 on CPU: log p(. | tokens 0..i) for each i but the last, computed as
    perplexity() computes them; two models' rows give the KL divergence one adds to the other's predictions."""
    rows = [torch.log_softmax(logits, -1).cpu() for logits, _ in _chunk_logits(model, backend, token_ids, chunk_size)]
    return torch.cat(rows)


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over rows of KL(reference || other), in nats, for two [rows, vocab] tensors of log-probabilities (the
    divergence `other`'s predictions add to `reference`'s)."""
    return (reference.exp() * (reference - other)).sum(-1).mean().item()


def _chunk_logits(model: DecoderForCausalLM, backend: AttentionBackend, token_ids: list[int],
                  chunk_size: int | None, kv_cache_dtype: torch.dtype | None = None
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per chunk of the text, prefilled into a private KV cache: the fp32 logits of its rows that have a next
    token, and those next tokens."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    device = next(model.parameters()).device
    dtype = model.model.norm.weight.dtype
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    allocate_kv_caches(model, KVCacheSpec(num_blocks, BLOCK_SIZE, kv_cache_dtype or dtype), device)
    ids = torch.tensor(token_ids, device=device)
    block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    step = chunk_size or num_tokens
    for start in range(0, num_tokens, step):
        end = min(start + step, num_tokens)
        common = AttentionMetadata(
            slot_mapping=torch.arange(start, end, device=device),
            block_tables=block_tables,
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            context_lens=torch.tensor([end], dtype=torch.int32, device=device),
            num_decode_reqs=0,
            max_query_len=end - start,
            max_context_len=end,
            block_size=BLOCK_SIZE,
        )
        hidden = model(ids[start:end], torch.arange(start, end, device=device), backend.build_metadata(common))
        targets = ids[start + 1 : end + 1]  # the last chunk has no next token for its last row
        yield model.compute_logits(hidden[: targets.shape[0]]), targets  # fp32
