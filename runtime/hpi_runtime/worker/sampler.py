"""Sampling from logits: logit bias, grammar masks, penalties, temperature, top-k / top-p / min-p, seeded
draws, logprobs.

Rows under a grammar (structured outputs) get its token bitmask applied, and only they: a step without one
pays a single None check.

Every row is processed with vectorised ops; only seeded rows draw their uniform one by one, from their own
generator re-seeded per output position, so a seeded request's tokens depend only on its seed and its
logits: not on the batch it shares, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpi_runtime.core.interface import TokenLogprobs
from hpi_runtime.structured.compiler import apply_bitmask_

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings for the rows of one step's logits (row i = request i)."""

    temperature: torch.Tensor  # [S] float32; 0 = greedy
    top_k: torch.Tensor  # [S] int64; 0 = off
    top_p: torch.Tensor  # [S] float32; 1 = off
    min_p: torch.Tensor  # [S] float32; 0 = off
    seeds: tuple[int | None, ...]  # per row: the seed for this draw (already mixed with the position)
    num_logprobs: tuple[int | None, ...]  # per row: top-n to return, None = no logprobs
    # Penalties: None when no row uses any (the common case, skips all the work).
    presence_penalty: torch.Tensor | None = None  # [S] float32
    frequency_penalty: torch.Tensor | None = None  # [S] float32
    repetition_penalty: torch.Tensor | None = None  # [S] float32
    prompt_token_ids: tuple[tuple[int, ...], ...] = ()
    output_token_ids: tuple[tuple[int, ...], ...] = ()
    banned_token_ids: tuple[tuple[int, ...], ...] = ()  # per row, e.g. EOS before min_tokens
    logit_bias: tuple[tuple[tuple[int, float], ...], ...] = ()  # per row (token id, bias); () when no row has any
    grammar_rows: torch.Tensor | None = None  # [R] int64: the rows under a grammar
    grammar_bitmask: torch.Tensor | None = None  # [R, ceil(V / 32)] int32: allowed next tokens of those rows


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # [S, V] float32: the distribution each sampled row drew from (greedy rows: meaningless); None when every
    # row is greedy. Rejection sampling of a draft model's drafts reads it.
    probs: torch.Tensor | None = None


def mix_seed(seed: int, position: int) -> int:
    """A well-spread 63-bit seed for draw number `position` of a request seeded with `seed` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _counts(token_lists: tuple[tuple[int, ...], ...], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[S, V] float32 occurrence counts of each row's tokens."""
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    for row, ids in enumerate(token_lists):
        if ids:
            index = torch.tensor(ids, device=device)
            counts[row].index_add_(0, index, torch.ones(len(ids), device=device))
    return counts


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (HF/vLLM), presence/frequency over output tokens (OpenAI)."""
    vocab_size = logits.shape[1]
    output_counts = _counts(batch.output_token_ids, vocab_size, logits.device)
    if batch.repetition_penalty is not None:
        seen = (_counts(batch.prompt_token_ids, vocab_size, logits.device) + output_counts) > 0
        penalty = batch.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty[:, None] * output_counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty[:, None] * (output_counts > 0)
    return logits


_FILTER_CANDIDATES = 256  # a row's best tokens its filters are looked for in first (then its whole vocabulary)


def apply_top_k_top_p_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, nucleus top-p and min-p sets, in that order. A row with
    none of the three keeps its logits.

    The sets are looked for among each row's best _FILTER_CANDIDATES tokens first (torch.topk, in order), and
    only the rows whose sets might reach past them sort their whole vocabulary: that sort costs ~2 ms a row on
    CPU for a 49k vocabulary (65-75 ms a step for 32 rows), and a confident model's nucleus at top-p 0.95 is
    often a handful of tokens. A row whose nucleus is wider pays both (1.2-1.3x the sort alone);
    bench/results/sampler.md. Probabilities are the whole row's softmax, or the top-k set's where top-k applies,
    as a full sort gives them."""
    num_rows, vocab = logits.shape
    top_k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)
    filtered = (top_k < vocab) | (batch.top_p < 1) | (batch.min_p > 0)
    out = logits.clone()
    full_lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    pending = filtered.nonzero().squeeze(1)
    for k in sorted({min(vocab, _FILTER_CANDIDATES), vocab}):  # the candidates, then the whole vocabulary
        if not pending.numel():
            break
        row_k, top_p, min_p = top_k[pending], batch.top_p[pending], batch.min_p[pending]
        rows_logits = logits[pending]
        values, ids = rows_logits.sort(dim=-1, descending=True) if k == vocab else rows_logits.topk(k, dim=-1)
        values = values.masked_fill(torch.arange(k, device=logits.device) >= row_k[:, None], float("-inf"))
        lse = torch.where((row_k < vocab)[:, None], torch.logsumexp(values, dim=-1, keepdim=True), full_lse[pending])
        probs = (values - lse).exp()
        mass = probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token goes when the mass before it already does.
        outside_top_p = (mass - probs) >= top_p[:, None]
        outside_top_p[:, 0] = False
        below_min_p = probs < min_p[:, None] * probs[:, :1]
        kept = values.masked_fill(outside_top_p | below_min_p, float("-inf"))
        # A row is done when every token past the k best is outside some filter: past top-k, or the mass before it
        # reaches top-p, or its probability is below the k-th's, which is below min-p. (A top-k past the k best is
        # not done: its set's normaliser is not among them.) The whole vocabulary finishes every row.
        whole_row = row_k == vocab
        done = (row_k <= k) | (whole_row & ((mass[:, -1] >= top_p) | (probs[:, -1] < min_p * probs[:, 0])))
        rows = pending[done]
        masked = torch.full((len(rows), vocab), float("-inf"), dtype=logits.dtype, device=logits.device)
        out[rows] = masked.scatter_(1, ids[done], kept[done])
        pending = pending[~done]
    return out


_DRAW_BLOCK = 256  # vocabulary entries per block of _draw's two-level search


def _last_positive(cdf: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Per row of a cumulative sum [S, N] with row totals [S, 1]: the index of the last entry of positive weight."""
    return torch.searchsorted(cdf, total, right=False)


def _draw(probs: torch.Tensor, seeds: tuple[int | None, ...], generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [S, V] by inverse transform sampling: a uniform draw per row (seeded rows from
    their own generator, the rest from the shared one) located in the row's cumulative sums, in fp64, in two
    levels: among the sums of blocks of _DRAW_BLOCK tokens, then within the chosen block. Zero-probability
    tokens are never chosen.

    One uniform per row instead of the exponential race's one Exp(1) draw per vocabulary entry, which torch makes
    one at a time on CPU (~19 ns each: 1.0 ms a row for a 49k vocabulary, 32 ms a step for 32 sampled requests,
    as long as the model step). The two levels keep every temporary small: a whole-row fp64 cumulative sum is
    12 MB at 32 rows, and glibc hands buffers that size back to the OS when freed, so each step paid its page
    faults again (2.3 ms instead of 0.25 at 8 rows). bench/results/sampler.md."""
    num_rows, vocab = probs.shape
    uniform = torch.rand((num_rows, 1), dtype=torch.float64, device=probs.device, generator=generator)
    row_generator = torch.Generator(device=probs.device)
    for row, seed in enumerate(seeds):
        if seed is not None:
            row_generator.manual_seed(seed)
            uniform[row] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=row_generator)
    whole = vocab // _DRAW_BLOCK * _DRAW_BLOCK
    block_sums = probs[:, :whole].view(num_rows, -1, _DRAW_BLOCK).sum(dim=-1, dtype=torch.float64)
    if whole < vocab:
        block_sums = torch.cat((block_sums, probs[:, whole:].sum(dim=-1, keepdim=True, dtype=torch.float64)), dim=1)
    block_cdf = block_sums.cumsum(dim=-1)
    total = block_cdf[:, -1:].contiguous()
    target = uniform * total
    # u * total may round up to total: the last block of positive weight is as far as a draw may land.
    block = torch.minimum(torch.searchsorted(block_cdf, target, right=True), _last_positive(block_cdf, total))
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * _DRAW_BLOCK + torch.arange(_DRAW_BLOCK, device=probs.device)  # [S, _DRAW_BLOCK]
    inside = torch.where(columns < vocab, probs.gather(1, columns.clamp(max=vocab - 1)), 0.0)
    inside_cdf = inside.cumsum(dim=-1, dtype=torch.float64)
    inside_total = inside_cdf[:, -1:].contiguous()
    # The block's own sum may differ from its share of block_cdf in the last bits: clamp as above.
    offset = torch.minimum(torch.searchsorted(inside_cdf, target - before, right=True),
                           _last_positive(inside_cdf, inside_total))  # fmt: skip
    return columns.gather(1, offset).squeeze(1)


def logprobs_of(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: tuple[int | None, ...]
) -> list[TokenLogprobs | None]:
    """raw_logits: [S, V], token_ids: [S] -> logprobs of each row's token under the model's own distribution
    (before penalties and temperature), as vLLM reports them, with the row's top-n; None where n is None."""
    wanted = [n for n in num_logprobs if n is not None]
    if not wanted:
        return [None] * len(num_logprobs)
    logprobs = raw_logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    top_values, top_ids = logprobs.topk(max(wanted), dim=-1) if max(wanted) else (None, None)
    results: list[TokenLogprobs | None] = []
    for row, n in enumerate(num_logprobs):
        if n is None:
            results.append(None)
            continue
        top = tuple(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True)) if n else ()
        results.append(TokenLogprobs(token_id=int(token_ids[row]), logprob=chosen[row], top=top))
    return results


def _apply_logit_bias(logits: torch.Tensor, biases: tuple[tuple[tuple[int, float], ...], ...]) -> torch.Tensor:
    """logits: [S, V] -> a copy with each row's (token id, bias) pairs added (ids past V are ignored)."""
    vocab_size = logits.shape[1]
    entries = [(row, t, b) for row, pairs in enumerate(biases) for t, b in pairs if t < vocab_size]
    if not entries:
        return logits
    rows, token_ids, values = zip(*entries, strict=True)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device))
    return logits.index_put(index, torch.tensor(values, device=device, dtype=logits.dtype), accumulate=True)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        # Draws for unseeded requests: reproducible per engine seed, but they depend on batch order.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [S, V] float32 -> one token per row."""
        raw_logits = logits
        if batch.logit_bias:
            logits = _apply_logit_bias(logits, batch.logit_bias)
        for row, banned in enumerate(batch.banned_token_ids):
            if banned:
                logits = logits.clone() if logits is raw_logits else logits
                logits[row, list(banned)] = float("-inf")
        if batch.grammar_bitmask is not None:
            if logits is raw_logits and any(n is not None for n in batch.num_logprobs):
                logits = logits.clone()  # logprobs are of the model's own distribution
            apply_bitmask_(logits, batch.grammar_rows.to(logits.device), batch.grammar_bitmask)
        if batch.output_token_ids:
            logits = apply_penalties(logits, batch)
        # max's indices are argmax's (the first of equal maxima, NaN as the maximum), at 0.4x its time on CPU:
        # 0.8 against 2.1 ms over 64 rows of a 49,152-token vocabulary (bench/bench_sampler.py).
        greedy_ids = logits.max(dim=-1).indices
        is_greedy = batch.temperature == 0
        probs = None
        if bool(is_greedy.all()):
            token_ids = greedy_ids
        else:
            temperature = torch.where(is_greedy, 1.0, batch.temperature)
            scaled = logits / temperature[:, None]
            if bool((batch.top_k > 0).any() | (batch.top_p < 1).any() | (batch.min_p > 0).any()):
                scaled = apply_top_k_top_p_min_p(scaled, batch)
            probs = scaled.softmax(dim=-1)
            sampled_ids = _draw(probs, batch.seeds, self.generator)
            token_ids = torch.where(is_greedy, greedy_ids, sampled_ids)
        return SamplerOutput(token_ids.tolist(), logprobs_of(raw_logits, token_ids, batch.num_logprobs), probs)
