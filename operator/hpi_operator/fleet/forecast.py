"""The demand to plan for: today's request rate, plus its rise over the time a new replica takes to start.

A replica added now serves only after its pod is scheduled, its weights load and its engine warms up (one to
three minutes for an 8B model on a GPU). Planning for the rate measured now is then always one start time late on
a rising day: the fleet simulator (bench/results/fleet.md) lost most of its SLO misses on the morning ramp that
way. So the optimizer plans for the rate forecast `lead_s` ahead, by Holt's linear trend (double exponential
smoothing, with the poll's irregular interval): a smoothed level and a smoothed slope of the measured rate.

- Only a rising slope is extrapolated. A falling one is left to the scale-down window, which already waits for a
  dip to last; extrapolating it would remove replicas ahead of a fall that may not come.
- The plan never goes below the rate measured now (a burst the level has not caught up with yet still counts).
- The slope is smoothed harder than the level (TREND_SMOOTHING < LEVEL_SMOOTHING): one poll's rate is a noisy
  count (Poisson: +-3% at 1,000 requests), and a slope amplifies the noise by lead / interval.
- The smoothing is per unit of time, not per poll: the weights are those of a poll every REFERENCE_POLL_S (the
  operator's default), and a reading `dt` after the previous one weighs 1 - (1 - weight) ** (dt / 15 s). With
  per-poll weights a 1 s poll would pass one reading's noise into the plan 150 times over at a 150 s lead (a
  +-1% rate became a plan 10% too high); with per-second weights the memory is the same seconds at any poll.

How far ahead (`lead_time`): spec.autoscaling.leadTimeSeconds when set; otherwise the start time its pods
measured (creation to Ready, the 90th percentile of a pool's ready pods, kept in status while a pool has none) of
the slowest-starting pool that can meet the SLO, plus two polls: the rate a poll measures is an average over the
poll before it (and Holt's level trails a ramp), and what a poll decides is corrected only one poll later. In the
fleet simulator's compressed day (bench/results/fleet.md) a lead of the start time alone held 98.8% of requests
within the SLO, start + one poll 99.0%, start + two polls 99.1%.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

REFERENCE_POLL_S = 15.0  # the weights below are per poll of this length (the operator's default interval)
LEVEL_SMOOTHING = 0.5  # weight of the newest rate in the level
TREND_SMOOTHING = 0.2  # weight of the newest level change in the slope
ASSUMED_START_S = 120.0  # a pool with no pod seen starting yet: an 8B model on a GPU takes one to three minutes
LAG_POLLS = 2  # the measured rate's age (about a poll) and the wait for the next correction (one poll)
FALL_FRACTION = 0.02  # falling(): the share of the level the slope must take off over one lead
CLIFF_FRACTION = 0.5  # falling(): a rate measured below this share of the level is a cliff, not a trend
MAX_LEAD_S = 600.0  # a longer "start" is a pod that waited for a node, not a time a trend can be projected over


@dataclass(frozen=True)
class Trend:
    level: float  # requests per second, smoothed
    slope: float  # requests per second, per second
    at_s: float  # when it was last updated (epoch seconds)


def weight(per_reference_poll: float, dt: float) -> float:
    """The weight of a reading taken `dt` seconds after the previous one, for a smoothing whose weight per poll of
    REFERENCE_POLL_S is `per_reference_poll`: what is left of the past decays by the same factor per second."""
    return 1.0 - (1.0 - per_reference_poll) ** (dt / REFERENCE_POLL_S)


def update(previous: Trend | None, rate: float, now_s: float) -> Trend:
    """Fold the rate measured at `now_s` into the trend."""
    if previous is None or now_s <= previous.at_s:
        return Trend(rate, previous.slope if previous else 0.0, now_s)
    dt = now_s - previous.at_s
    expected = max(previous.level + previous.slope * dt, 0.0)
    level_weight, trend_weight = weight(LEVEL_SMOOTHING, dt), weight(TREND_SMOOTHING, dt)
    level = level_weight * rate + (1 - level_weight) * expected
    slope = trend_weight * (level - previous.level) / dt + (1 - trend_weight) * previous.slope
    return Trend(level, slope, now_s)


def falling(trend: Trend | None, measured_rate: float, lead_s: float) -> bool:
    """Whether the demand is on a falling trend: the slope would take more than FALL_FRACTION of the level off
    over one lead time (a flat day's noise moves the smoothed slope far less), and the rate measured now is still
    at least CLIFF_FRACTION of the level. The optimizer then releases replicas after two polls instead of a
    lead-long window (spec.AutoscalingSpec.scale_down_window_s). A cliff (the rate falling to a fraction of the
    level in one poll: clients gone, an outage upstream) is no trend: it may come back as suddenly, so its
    replicas are held for the lead time, as before."""
    if trend is None or measured_rate <= CLIFF_FRACTION * trend.level:  # a cliff, or nothing left to fall
        return False
    return -trend.slope * lead_s > FALL_FRACTION * trend.level


def planned_rate(trend: Trend, measured_rate: float, lead_s: float) -> float:
    """The rate to plan for: the level `lead_s` ahead on a rising slope, never below what was measured now."""
    if lead_s < 0:
        raise ValueError(f"lead_s must be >= 0, got {lead_s}")
    return max(measured_rate, trend.level + max(trend.slope, 0.0) * lead_s)


@dataclass(frozen=True)
class Lead:
    seconds: float
    source: str  # spec | measured | assumed (no pod of that pool seen starting: ASSUMED_START_S)
    pool: str | None = None  # the pool whose start time set it
    start_s: float | None = None  # that pool's start time


def start_times(seen: Mapping[str, Sequence[float]], remembered: Mapping[str, float]) -> dict[str, float]:
    """Each pool's start time: the 90th percentile (nearest rank) of the starts of its ready pods this poll; a
    pool with none keeps the remembered value (a pool scaled to zero still starts as slowly)."""
    out = dict(remembered)
    for pool, starts in seen.items():
        if starts:
            ordered = sorted(starts)
            out[pool] = ordered[max(math.ceil(0.9 * len(ordered)) - 1, 0)]
    return out


def lead_time(configured_s: float | None, starts: Mapping[str, float], pools: Iterable[str], poll_s: float) -> Lead:
    """How far ahead to plan: `configured_s` (spec.autoscaling.leadTimeSeconds) when set, else the slowest start
    among `pools` (those that can serve within the SLO) plus LAG_POLLS polls, at most MAX_LEAD_S."""
    if configured_s is not None:
        return Lead(float(configured_s), "spec")
    if poll_s < 0:
        raise ValueError(f"poll_s must be >= 0, got {poll_s}")
    lag_s = LAG_POLLS * poll_s

    def lead(pool: str | None) -> Lead:
        start = starts.get(pool) if pool is not None else None
        source, start = ("assumed", ASSUMED_START_S) if start is None else ("measured", start)
        return Lead(min(start + lag_s, MAX_LEAD_S), source, pool, start)

    return max((lead(pool) for pool in sorted(pools)), key=lambda x: x.seconds, default=lead(None))
