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
"""

from __future__ import annotations

from dataclasses import dataclass

LEVEL_SMOOTHING = 0.5  # weight of the newest rate in the level
TREND_SMOOTHING = 0.2  # weight of the newest level change in the slope


@dataclass(frozen=True)
class Trend:
    level: float  # requests per second, smoothed
    slope: float  # requests per second, per second
    at_s: float  # when it was last updated (epoch seconds)


def update(previous: Trend | None, rate: float, now_s: float) -> Trend:
    """Fold the rate measured at `now_s` into the trend."""
    if previous is None or now_s <= previous.at_s:
        return Trend(rate, previous.slope if previous else 0.0, now_s)
    dt = now_s - previous.at_s
    expected = max(previous.level + previous.slope * dt, 0.0)
    level = LEVEL_SMOOTHING * rate + (1 - LEVEL_SMOOTHING) * expected
    slope = TREND_SMOOTHING * (level - previous.level) / dt + (1 - TREND_SMOOTHING) * previous.slope
    return Trend(level, slope, now_s)


def planned_rate(trend: Trend, measured_rate: float, lead_s: float) -> float:
    """The rate to plan for: the level `lead_s` ahead on a rising slope, never below what was measured now."""
    if lead_s < 0:
        raise ValueError(f"lead_s must be >= 0, got {lead_s}")
    return max(measured_rate, trend.level + max(trend.slope, 0.0) * lead_s)
