"""`hpi profile`: how fast this replica is, measured by the engine itself, in the form the operator's fleet
optimizer reads (spec.placement.pools[].performance):

- the decode step time against the batch size, fitted as ITL = alpha + beta x batch (least squares over the
  measured points, which are kept): each batch is `b` requests whose prompts fill `context_tokens` of context,
  timed over `steps` decode steps after their prefill. Each step reads every sequence's KV cache, which at a
  thousand tokens is much of a GPU's per-sequence cost (an 8B model on an H200 reads 128 MiB per sequence per
  step at 1,024 tokens, about 47 us; at 30 tokens the per-sequence cost measured 30 us of compute and sampling
  alone), so beta is measured at the context it will serve. Batches whose context the KV cache cannot hold are
  not timed, and listed (`decodeBatchesSkipped`);
- the prefill throughput (tokens per second) of one request per prompt length, timed from admission to its
  first token after one untimed prefill of that length; the figure kept is the highest over the lengths;
- the most sequences the KV cache holds at `context_tokens` each (whole blocks), capped by max_num_seqs.
The engine runs in this process, as `LLM` does; the numbers are wall-clock and belong to this machine (record
its ISA beside them, as `cpu` in the output does).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpi_runtime import cpu_features
from hpi_runtime.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine (and torch) only when measuring: `hpi profile --help` reads the defaults here
    from hpi_runtime.engine_factory import EngineBundle

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_PROMPT_LENGTHS = (128, 512)
MIN_DECODE_PROMPT_TOKENS = 16


@dataclass(frozen=True)
class ProfileResult:
    itl_alpha_ms: float
    itl_beta_ms: float
    prefill_tokens_per_s: float
    max_num_seqs: int
    decode_points: tuple[tuple[int, float], ...]  # (batch, ms per step)
    prefill_points: tuple[tuple[int, float], ...]  # (prompt tokens, tokens per second)
    context_tokens: int
    decode_batches_skipped: tuple[int, ...] = ()  # batches the KV cache cannot hold at context_tokens

    def as_json(self, extra: dict[str, object] | None = None) -> dict[str, object]:
        """spec.placement.pools[].performance's four fields first (paste them into the spec), then the points."""
        return {
            "itlAlphaMs": round(self.itl_alpha_ms, 4),
            "itlBetaMs": round(self.itl_beta_ms, 4),
            "prefillTokensPerSecond": round(self.prefill_tokens_per_s, 1),
            "maxNumSeqs": self.max_num_seqs,
            "contextTokens": self.context_tokens,
            "decodePoints": [[b, round(ms, 4)] for b, ms in self.decode_points],
            "prefillPoints": [[n, round(tps, 1)] for n, tps in self.prefill_points],
            **({"decodeBatchesSkipped": list(self.decode_batches_skipped)} if self.decode_batches_skipped else {}),
            **(extra or {}),
        }


TERMINATION_MESSAGE_LIMIT_BYTES = 4096  # what Kubernetes keeps of /dev/termination-log


def compact_json(payload: dict[str, object], limit_bytes: int = TERMINATION_MESSAGE_LIMIT_BYTES) -> str:
    """`hpi profile --compact`: one line without spaces, within `limit_bytes` (a Job's termination message, which
    the operator reads instead of pod logs). Should the points not fit, they go first: the fitted figures are
    what the operator needs."""
    text = json.dumps(payload, separators=(",", ":"))
    if len(text.encode()) > limit_bytes:
        text = json.dumps({k: v for k, v in payload.items() if not k.endswith("Points")}, separators=(",", ":"))
    if len(text.encode()) > limit_bytes:
        raise ValueError(f"the profile is {len(text.encode())} bytes, over the {limit_bytes}-byte limit")
    return text


def fit_itl(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(alpha, beta) of step = alpha + beta x batch by least squares with both >= 0 (a step never gets faster
    with more sequences, and never takes less than nothing). Where the free fit's intercept is negative (noise
    on few points), the slope is refitted through the origin rather than the intercept zeroed under the free
    slope, which would put the line below every point."""
    if not points:
        raise ValueError("need at least one (batch, step) point")
    if len(points) == 1 or len({b for b, _ in points}) == 1:
        return max(points[0][1], 0.0), 0.0
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((b - mean_b) ** 2 for b, _ in points)
    beta = sum((b - mean_b) * (t - mean_t) for b, t in points) / var
    if beta <= 0:
        return max(mean_t, 0.0), 0.0
    if mean_t - beta * mean_b < 0:
        return 0.0, max(sum(b * t for b, t in points) / sum(b * b for b, _ in points), 0.0)
    return mean_t - beta * mean_b, beta


def kv_bound_num_seqs(num_kv_blocks: int, block_size: int, context_tokens: int, max_num_seqs: int) -> int:
    """Sequences of `context_tokens` the KV cache holds in whole blocks (at least 1), at most max_num_seqs."""
    blocks_each = math.ceil(context_tokens / block_size)
    return max(1, min(max_num_seqs, num_kv_blocks // max(blocks_each, 1)))


def _prompt(length: int, vocab_size: int, salt: int) -> list[int]:
    # Distinct token ids per request so no prefix-cache hit shortens a prefill.
    return [(7 + salt * 131 + i * 17) % (vocab_size - 1) + 1 for i in range(length)]


def _decode_step_ms(bundle: EngineBundle, batch: int, steps: int, prompt_tokens: int, vocab_size: int,
                    salt: int) -> float:  # fmt: skip
    engine = bundle.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True)
    ids = [f"profile-decode-{salt}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, _prompt(prompt_tokens, vocab_size, salt * 1000 + i), params)
    first_tokens: set[str] = set()
    while len(first_tokens) < batch:  # every request prefilled and sampled once: from here on, pure decode
        first_tokens |= {o.request_id for o in engine.step() if o.output_token_ids}
    engine.step()  # untimed: the first step at a new batch size may compile or allocate
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps * 1e3


def _prefill_tokens_per_s(bundle: EngineBundle, length: int, vocab_size: int, salt: int) -> float:
    engine = bundle.engine
    request_id = f"profile-prefill-{salt}"
    engine.add_request(request_id, _prompt(length, vocab_size, 10_000 + salt), SamplingParams(max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return length / (time.perf_counter() - start)


def measure(
    bundle: EngineBundle,
    context_tokens: int,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    prompt_lengths: Sequence[int] = DEFAULT_PROMPT_LENGTHS,
    steps: int = 8,
) -> ProfileResult:
    """Measure `bundle`'s engine (idle when called; left idle)."""
    config = bundle.engine.config
    if context_tokens < 1 or steps < 1 or not batch_sizes or not prompt_lengths:
        raise ValueError("context_tokens and steps must be >= 1, batch_sizes and prompt_lengths non-empty")
    too_big = [b for b in batch_sizes if b > config.max_num_seqs or b < 1]
    if too_big:
        raise ValueError(f"batch sizes must lie in 1..max_num_seqs ({config.max_num_seqs}); got {too_big}")
    too_long = [n for n in prompt_lengths if n + 1 > config.max_model_len or n < 1]
    if too_long:
        raise ValueError(f"prompt lengths must lie in 1..max_model_len-1 ({config.max_model_len - 1}); got {too_long}")
    vocab_size = bundle.resolved.vocab_size
    footprint = bundle.footprint
    max_seqs = kv_bound_num_seqs(footprint.num_kv_blocks, footprint.block_size, context_tokens, config.max_num_seqs)
    # The timed steps run at about context_tokens of context: the prompt fills it, less the steps still to come.
    prompt_tokens = max(MIN_DECODE_PROMPT_TOKENS, min(context_tokens, config.max_model_len) - steps - 3)
    timed = sorted(b for b in set(batch_sizes) if b <= max_seqs) or [1]
    skipped = tuple(sorted(b for b in set(batch_sizes) if b not in timed))
    _decode_step_ms(bundle, 1, 2, prompt_tokens, vocab_size, salt=99)  # warm-up: compiles, first-touch allocations
    decode = tuple((b, _decode_step_ms(bundle, b, steps, prompt_tokens, vocab_size, salt=b)) for b in timed)
    lengths = sorted(set(prompt_lengths))
    for n in lengths:  # untimed: a new prompt length may compile the step for its shape
        _prefill_tokens_per_s(bundle, n, vocab_size, salt=20_000 + n)
    prefill = tuple((n, _prefill_tokens_per_s(bundle, n, vocab_size, salt=n)) for n in lengths)
    alpha, beta = fit_itl(decode)
    return ProfileResult(alpha, beta, max(tps for _, tps in prefill), max_seqs, decode, prefill, context_tokens,
                         skipped)  # fmt: skip


def machine() -> dict[str, object]:
    """What the numbers belong to: the CPU's bf16 support (AMX, AVX512-BF16, else neither)."""
    return {"cpu": {"amx": cpu_features.has_amx(), "avx512bf16": cpu_features.has_fast_bf16()}}
