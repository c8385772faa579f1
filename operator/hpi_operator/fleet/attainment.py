"""Observed SLO attainment, from the runtime pods' latency histograms: what the fleet actually delivered between
two polls, beside what the optimizer planned.

The issue's definition: SLO attainment is the fraction of requests whose TTFT and mean ITL are both within the
targets. The pods export two separate cumulative histograms, `vllm:time_to_first_token_seconds` (one sample per
request) and `vllm:request_time_per_output_token_seconds` (one per request with two or more output tokens: its
mean ITL). Separate histograms cannot give the joint fraction, and a bucket only says a sample lies somewhere
between its bounds, so this module reports an honest lower bound instead of a guess:

    attainment >= 1 - P(TTFT > ttft target) - P(mean ITL > itl target)        (the union bound)

where each P counts every sample not known to be within its target as missing: a bucket whose range straddles
the target counts entirely as over it. The true attainment is at least this; it equals it when the buckets have a
bound at each target and no request misses both. A request with one output token has no ITL: it misses only on
TTFT. The p90s are Prometheus' `histogram_quantile` (linear interpolation inside the bucket that holds the rank,
the last finite bound when it falls in +Inf), so they match a dashboard over the same buckets.

Like the demand counters (demand.py), each poll diffs each pod's buckets against the previous poll's, kept in
status: a new pod, a restarted one (a count went back) or one whose bounds changed contributes from the next
poll. All pure; the scrape reads the buckets (autoscaling/scrape.py), fleet_loop.py persists them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..autoscaling.decision import Buckets, PodLoad
from .performance import Slo

QUANTILE = 0.9
_REL_EPS = 1e-9  # a target given as "100ms" and a bucket bound 0.1 must compare equal


@dataclass(frozen=True)
class ObservedSlo:
    """What the requests that finished between two polls saw, summed over the pods."""

    attainment: float | None  # the lower bound above; None without requests
    ttft_p90_s: float | None
    itl_p90_s: float | None  # of the per-request mean ITL
    requests: int  # TTFT samples: requests that produced a first token
    window_s: float


@dataclass(frozen=True)
class LatencyReading:
    observed: ObservedSlo | None  # None on the first poll (nothing to diff against)
    histograms: Mapping[str, tuple[Buckets, Buckets]]  # per pod (TTFT, TPOT), to diff against at the next poll


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets ending in +Inf; None when
    there is no sample or no +Inf bucket."""
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]) or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    index = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if index == len(buckets) - 1:
        return buckets[-2][0]
    upper, count = buckets[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = buckets[index - 1] if index > 0 else (0.0, 0.0)
    return lower + (upper - lower) * (rank - below) / (count - below)


def num_over(target_s: float, buckets: Buckets) -> float:
    """Samples not known to be within `target_s`: all but those in buckets whose upper bound is within it (a
    bucket that straddles the target counts as over it)."""
    within = [count for upper, count in buckets if upper <= target_s * (1 + _REL_EPS)]
    return buckets[-1][1] - (within[-1] if within else 0.0) if buckets else 0.0


def attainment_lower_bound(slo: Slo, ttft: Buckets, tpot: Buckets) -> float | None:
    """1 - P(TTFT over) - P(mean ITL over), per request (TTFT's count), clamped to [0, 1]; None without requests."""
    requests = ttft[-1][1] if ttft else 0.0
    if requests <= 0:
        return None
    missed = num_over(slo.ttft_p90_s, ttft) + num_over(slo.itl_p90_s, tpot)
    return min(1.0, max(0.0, 1.0 - missed / requests))


def diff(now: Buckets, before: Buckets) -> Buckets | None:
    """The samples between two readings of one pod's histogram; None when they cannot be compared (bounds
    changed, or a count went back: the pod restarted)."""
    if len(now) != len(before) or any(a[0] != b[0] or a[1] < b[1] for a, b in zip(now, before, strict=True)):
        return None
    return tuple((upper, count - old) for (upper, count), (_, old) in zip(now, before, strict=True))


def merge(histograms: Sequence[Buckets]) -> Buckets:
    """The sum of the histograms that share the bounds holding the most samples (every runtime pod exports the
    same bounds; a pod with other bounds, say a stock vLLM of another version, cannot be added bucket by bucket
    and is left out of the sum)."""
    groups: dict[tuple[float, ...], list[Buckets]] = {}
    for histogram in histograms:
        if histogram:
            groups.setdefault(tuple(upper for upper, _ in histogram), []).append(histogram)
    if not groups:
        return ()
    bounds, members = max(groups.items(), key=lambda item: sum(h[-1][1] for h in item[1]))
    return tuple((upper, sum(h[i][1] for h in members)) for i, upper in enumerate(bounds))


def read_latency(loads: Sequence[PodLoad], previous: Mapping[str, tuple[Buckets, Buckets]],
                 window_s: float | None, slo: Slo) -> LatencyReading:  # fmt: skip
    """This poll's observed attainment and p90s (None on the first poll), and the buckets to remember."""
    histograms: dict[str, tuple[Buckets, Buckets]] = {}
    ttfts: list[Buckets] = []
    tpots: list[Buckets] = []
    for load in loads:
        if not load.ttft_buckets or not load.tpot_buckets:
            continue
        histograms[load.pod] = (load.ttft_buckets, load.tpot_buckets)
        before = previous.get(load.pod)
        if before is None:
            continue
        ttft, tpot = diff(load.ttft_buckets, before[0]), diff(load.tpot_buckets, before[1])
        if ttft is not None and tpot is not None:
            ttfts.append(ttft)
            tpots.append(tpot)
    if window_s is None or window_s <= 0:
        return LatencyReading(None, histograms)
    ttft, tpot = merge(ttfts), merge(tpots)
    observed = ObservedSlo(
        attainment=attainment_lower_bound(slo, ttft, tpot),
        ttft_p90_s=histogram_quantile(QUANTILE, ttft),
        itl_p90_s=histogram_quantile(QUANTILE, tpot),
        requests=int(ttft[-1][1]) if ttft else 0,
        window_s=window_s,
    )
    return LatencyReading(observed, histograms)


# -- the resource representation ------------------------------------------------------------------------------


def histograms_to_status(histograms: Mapping[str, tuple[Buckets, Buckets]]) -> dict[str, Any] | None:
    """Each pod's buckets for status.autoscaling.optimizer.histograms, compactly: the finite bounds once, then per
    pod its cumulative counts (the last one +Inf's), so a fleet of hundreds of pods keeps a small status. The bounds
    are the ones most pods share; a pod with others is not remembered (merge would leave it out anyway)."""
    if not histograms:
        return None
    shapes = Counter(tuple(tuple(upper for upper, _ in b[:-1]) for b in pair) for pair in histograms.values())
    (ttft_bounds, tpot_bounds), _ = shapes.most_common(1)[0]
    pods = {pod: [[count for _, count in ttft], [count for _, count in tpot]]
            for pod, (ttft, tpot) in sorted(histograms.items())
            if tuple(u for u, _ in ttft[:-1]) == ttft_bounds and tuple(u for u, _ in tpot[:-1]) == tpot_bounds}
    return {"bounds": {"ttft": list(ttft_bounds), "tpot": list(tpot_bounds)}, "pods": pods}  # fmt: skip


def _buckets(bounds: Sequence[Any], counts: Sequence[Any]) -> Buckets:
    if len(counts) != len(bounds) + 1:
        raise ValueError("a histogram has one count per finite bound and one for +Inf")
    return tuple(zip((*(float(b) for b in bounds), math.inf), (float(c) for c in counts), strict=True))


def histograms_from_status(raw: Any) -> dict[str, tuple[Buckets, Buckets]]:
    """Inverse of `histograms_to_status`; whatever is mangled reads as not remembered (those pods restart their
    diff at this poll), never raises."""
    try:
        bounds = raw["bounds"]
        pods = dict(raw["pods"])
    except (TypeError, KeyError, ValueError):
        return {}
    out = {}
    for pod, pair in pods.items():
        try:
            out[str(pod)] = (_buckets(bounds["ttft"], pair[0]), _buckets(bounds["tpot"], pair[1]))
        except (TypeError, KeyError, ValueError, IndexError):
            continue
    return out


def observed_to_status(observed: ObservedSlo) -> dict[str, Any]:
    """status.autoscaling.optimizer.slo: seconds as numbers, the attainment as a fraction (a lower bound)."""

    def rounded(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    return {"attainment": rounded(observed.attainment, 4), "ttftP90": rounded(observed.ttft_p90_s, 4),
            "itlP90": rounded(observed.itl_p90_s, 5), "requests": observed.requests,
            "window": round(observed.window_s, 3)}  # fmt: skip


def describe(observed: ObservedSlo | None) -> str:
    """One clause for the decision message and the SLOAttainable condition."""
    if observed is None:
        return ""
    if observed.requests == 0 or observed.attainment is None:
        return f"observed: no request in the last {observed.window_s:.0f}s"
    ttft = "-" if observed.ttft_p90_s is None else f"{observed.ttft_p90_s:.3g}s"
    itl = "-" if observed.itl_p90_s is None else f"{observed.itl_p90_s * 1e3:.3g}ms"
    return (f"observed: SLO attainment >= {observed.attainment:.1%} of {observed.requests} requests in "
            f"{observed.window_s:.0f}s, TTFT p90 {ttft}, ITL p90 {itl}")  # fmt: skip
