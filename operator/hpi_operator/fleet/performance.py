"""How fast one replica of a pool is, and how much traffic it sustains within a latency SLO.

A pool's performance is what `hpi profile` measures on it (or, where nothing was measured, published figures,
marked `source: assumed`): the decode step time as a line in the batch size (ITL = alpha + beta x batch, the
fit llm-d's variant autoscaler also uses), the prefill throughput, and the most sequences its KV budget holds.

The per-replica model under continuous batching with chunked prefill (docs/autoscaling.md, "optimizer"):
a replica running `b` sequences takes steps of ITL(b) plus the time its share of prefill tokens adds to them,
so with prefill throughput F, mean prompt P and mean output O tokens, at request rate mu:
    step = ITL(b) / (1 - mu * P / F)        (prefill chunks ride along in the decode steps)
    mu   = b / (O * ITL(b) + b * P / F)     (each request holds a slot for O steps)
The replica's capacity within the SLO is mu at the largest b whose step time stays within the ITL target and
whose time to first token (its prompt's prefill plus one step) stays within the TTFT target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpi_contracts.pool_profile import PoolProfile

SOURCES = ("measured", "assumed", "override")
P90_Z = 1.2816  # the standard normal's 90th percentile


@dataclass(frozen=True)
class PoolPerformance:
    itl_alpha_s: float  # decode step time with an empty batch (the fixed cost of one pass over the weights)
    itl_beta_s: float  # added step time per sequence in the batch
    prefill_tokens_per_s: float
    max_num_seqs: int  # the most sequences the KV budget holds at the workload's context length
    source: str = "measured"

    def __post_init__(self) -> None:
        if self.itl_alpha_s < 0 or self.itl_beta_s < 0 or self.itl_alpha_s + self.itl_beta_s <= 0:
            raise ValueError("ITL alpha and beta must be >= 0 and not both 0")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")

    def itl_s(self, batch: int) -> float:
        return self.itl_alpha_s + self.itl_beta_s * batch

    @classmethod
    def from_profile(cls, profile: PoolProfile) -> PoolPerformance:
        """The optimizer's form (seconds) of the figures as they travel (hpi_contracts.pool_profile, ms)."""
        return cls(profile.itl_alpha_ms / 1e3, profile.itl_beta_ms / 1e3, profile.prefill_tokens_per_s,
                   profile.max_num_seqs, profile.source)  # fmt: skip

    def as_profile(self) -> PoolProfile:
        return PoolProfile(self.itl_alpha_s * 1e3, self.itl_beta_s * 1e3, self.prefill_tokens_per_s,
                           self.max_num_seqs, self.source)  # fmt: skip


@dataclass(frozen=True)
class Demand:
    """The traffic to serve: what the router and the runtimes count (request rate, input/output token mix)."""

    request_rate: float  # requests per second
    mean_prompt_tokens: float
    mean_output_tokens: float

    def __post_init__(self) -> None:
        if self.request_rate < 0 or self.mean_prompt_tokens < 0 or self.mean_output_tokens < 1:
            raise ValueError("demand needs request_rate >= 0, mean_prompt_tokens >= 0, mean_output_tokens >= 1")


@dataclass(frozen=True)
class Slo:
    ttft_p90_s: float
    itl_p90_s: float

    def __post_init__(self) -> None:
        if self.ttft_p90_s <= 0 or self.itl_p90_s <= 0:
            raise ValueError("SLO targets must be > 0")


@dataclass(frozen=True)
class ReplicaCapacity:
    """What one replica of a pool sustains for a demand: within the SLO if `meets_slo`, else flat out."""

    request_rate: float  # requests per second
    batch: int  # sequences in flight at that rate
    step_s: float  # mean decode step (inter-token latency) at that rate
    ttft_s: float  # prefill of the TTFT prompt plus one step
    meets_slo: bool
    why_not: str | None = None  # for a pool that cannot meet the SLO at any load

    @property
    def slo_max_num_seqs(self) -> int:
        """The pool's planned SLO batch, as the router shares load by it (hpi_contracts.pool_profile): this batch
        within the SLO; 1 for a pool that cannot meet it at any load, so that it takes a request only as the
        pools that can fill up (each request there misses the SLO)."""
        return self.batch if self.meets_slo else 1


def _rate(perf: PoolPerformance, demand: Demand, batch: int) -> tuple[float, float]:
    """(requests/s, mean step seconds) of one replica holding `batch` sequences."""
    itl = perf.itl_s(batch)
    prefill_s = demand.mean_prompt_tokens / perf.prefill_tokens_per_s
    rate = batch / (demand.mean_output_tokens * itl + batch * prefill_s)
    busy = min(rate * prefill_s, 0.999_999)  # the fraction of time prefill adds to the steps
    return rate, itl / (1.0 - busy)


def p90_batch(mean_batch: float, max_num_seqs: int) -> float:
    """The batch a replica runs at or under 90% of the time when it holds `mean_batch` on average: requests arrive
    independently and each holds a slot for its own time, so the count in service is Poisson (an M/G/inf queue)
    with that mean, about mean + 1.28 sqrt(mean) at its 90th percentile; never more than the engine runs."""
    return min(mean_batch + P90_Z * math.sqrt(mean_batch), float(max_num_seqs))


def _p90_step(perf: PoolPerformance, demand: Demand, rate: float, mean_step: float, batch: int) -> float:
    """A request's mean inter-token time at its 90th percentile: the decode step at the p90 batch, plus the
    prefills that land while it decodes, spread over its output tokens. Those prefills arrive at `rate` over the
    request's O * step seconds, a Poisson count; each stalls the batch for its prompt's prefill time."""
    prefill_s = demand.mean_prompt_tokens / perf.prefill_tokens_per_s
    landing = rate * demand.mean_output_tokens * mean_step
    stall_s = prefill_s * (landing + P90_Z * math.sqrt(landing)) / demand.mean_output_tokens
    return perf.itl_s(p90_batch(batch, perf.max_num_seqs)) + stall_s


def replica_capacity(perf: PoolPerformance, demand: Demand, slo: Slo) -> ReplicaCapacity:
    """One replica's sustainable request rate within `slo`: the largest mean batch at which a request's mean
    inter-token time stays within itlP90 at its 90th percentile (_p90_step: the p90 batch, and the p90 count of
    other requests' prefills stalling its decode), and its prompt's prefill plus one such step within ttftP90.
    Planning at the mean step would put about half the requests over the target."""
    ttft_prefill_s = demand.mean_prompt_tokens / perf.prefill_tokens_per_s
    best: ReplicaCapacity | None = None
    low, high = 1, perf.max_num_seqs
    while low <= high:  # step time grows with the batch: binary search the largest batch within the targets
        mid = (low + high) // 2
        rate, step = _rate(perf, demand, mid)
        step = _p90_step(perf, demand, rate, step, mid)
        if step <= slo.itl_p90_s and ttft_prefill_s + step <= slo.ttft_p90_s:
            best = ReplicaCapacity(rate, mid, step, ttft_prefill_s + step, True)
            low = mid + 1
        else:
            high = mid - 1
    if best is not None:
        return best
    rate, step = _rate(perf, demand, perf.max_num_seqs)
    _, step_one = _rate(perf, demand, 1)
    reasons = []
    if step_one > slo.itl_p90_s:
        reasons.append(f"{step_one * 1e3:.0f} ms per token with one sequence (itlP90 {slo.itl_p90_s * 1e3:.0f} ms)")
    if ttft_prefill_s + step_one > slo.ttft_p90_s:
        reasons.append(f"a {demand.mean_prompt_tokens:.0f}-token prompt takes {ttft_prefill_s * 1e3:.0f} ms to "
                       f"prefill (ttftP90 {slo.ttft_p90_s * 1e3:.0f} ms)")  # fmt: skip
    why = ", ".join(reasons)
    return ReplicaCapacity(rate, perf.max_num_seqs, step, ttft_prefill_s + step, False, why)
