"""Per-request latencies and the run's summary: what bench/loadgen.py reports for a real run (TTFT, ITL,
throughput, p50/p90/p99), plus SLO attainment and cost.

SLO attainment is the issue's definition: the fraction of requests whose TTFT and whose mean ITL (the gaps
between its tokens after the first, averaged over the request) are both within the targets. A request that
never got a replica counts as a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpi_operator.fleet.performance import Slo


@dataclass(frozen=True, slots=True)
class RequestResult:
    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    pool: str
    num_preemptions: int

    @property
    def mean_itl_s(self) -> float:
        """0 for a one-token answer (it has no gap)."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float | None]:
    """Linearly interpolated percentiles, the same rule as bench/loadgen.py (in the values' own unit)."""
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for q in qs:
        if not ordered:
            out[f"p{q}"] = None
            continue
        pos = (len(ordered) - 1) * q / 100
        lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
        out[f"p{q}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return out


def within(result: RequestResult, slo: Slo) -> bool:
    return result.ttft_s <= slo.ttft_p90_s and result.mean_itl_s <= slo.itl_p90_s


def summarize(results: Sequence[RequestResult], num_unserved: int, slo: Slo | None, cost: float,
              duration_s: float) -> dict:  # fmt: skip
    """The run's figures (latencies in ms, cost in dollars)."""
    output_tokens = sum(r.output_tokens for r in results)
    total = len(results) + num_unserved
    summary = {
        "num_requests": total,
        "num_finished": len(results),
        "num_unserved": num_unserved,
        "num_preempted": sum(1 for r in results if r.num_preemptions),
        "ttft_ms": _ms(percentiles([r.ttft_s for r in results])),
        "itl_ms": _ms(percentiles([r.mean_itl_s for r in results if r.output_tokens > 1])),
        "e2e_ms": _ms(percentiles([r.e2e_s for r in results])),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s,
        "requests_per_s": len(results) / duration_s,
        "cost_usd": round(cost, 4),
        "cost_per_million_output_tokens": round(cost / output_tokens * 1e6, 4) if output_tokens else None,
        "requests_by_pool": _by_pool(results),
    }
    if slo is not None:
        summary["slo_attainment"] = sum(1 for r in results if within(r, slo)) / total if total else None
        summary["misses_by_pool"] = _misses_by_pool(results, slo)
    return summary


def _misses_by_pool(results: Sequence[RequestResult], slo: Slo) -> dict[str, dict[str, float | int | None]]:
    """Per pool, the requests that missed the SLO by TTFT only, by mean ITL only and by both; the median prompt of
    those that missed TTFT and the median output of those that missed ITL, each beside the pool's own: which target
    a control's misses come from, where, and for which requests."""
    by_pool: dict[str, list[RequestResult]] = {}
    for r in results:
        by_pool.setdefault(r.pool, []).append(r)
    out: dict[str, dict[str, float | int | None]] = {}
    for name, pool in sorted(by_pool.items()):
        late = [r for r in pool if r.ttft_s > slo.ttft_p90_s]
        slow = [r for r in pool if r.mean_itl_s > slo.itl_p90_s]
        both = sum(1 for r in late if r.mean_itl_s > slo.itl_p90_s)
        out[name] = {"ttft": len(late) - both, "itl": len(slow) - both, "both": both,
                     "prompt_p50": _median([r.prompt_tokens for r in pool]),
                     "late_prompt_p50": _median([r.prompt_tokens for r in late]),
                     "output_p50": _median([r.output_tokens for r in pool]),
                     "slow_output_p50": _median([r.output_tokens for r in slow])}  # fmt: skip
    return out


def _median(values: Sequence[int]) -> float | None:
    return percentiles(values, (50,))["p50"]


def _ms(values: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else round(v * 1e3, 2) for k, v in values.items()}


def _by_pool(results: Sequence[RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.pool] = counts.get(r.pool, 0) + 1
    return counts
