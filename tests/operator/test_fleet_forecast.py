"""The demand the optimizer plans for on a rise (fleet/forecast.py): Holt's linear trend, rising slopes only, never
below the rate measured now. Hand-solvable cases and the properties that keep it from flapping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpi_operator.fleet.forecast import LEVEL_SMOOTHING, TREND_SMOOTHING, Trend, planned_rate, update


def test_the_first_reading_is_the_level_with_no_slope() -> None:
    trend = update(None, 10.0, 100.0)
    assert trend == Trend(10.0, 0.0, 100.0)
    assert planned_rate(trend, 10.0, 120) == 10.0


def test_one_step_by_hand() -> None:
    trend = update(Trend(10.0, 0.0, 0.0), 20.0, 10.0)
    level = LEVEL_SMOOTHING * 20 + (1 - LEVEL_SMOOTHING) * 10  # 15
    slope = TREND_SMOOTHING * (level - 10) / 10  # 0.1 req/s per s
    assert trend.level == pytest.approx(level) and trend.slope == pytest.approx(slope)
    assert planned_rate(trend, 20.0, 120) == pytest.approx(max(20.0, level + slope * 120))  # 27


def test_a_steady_ramp_is_planned_ahead_by_about_the_lead_time() -> None:
    trend, rate = None, 0.0
    for t in range(0, 1800, 15):  # +0.1 req/s every second, polled every 15 s
        rate = 10 + 0.1 * t
        trend = update(trend, rate, float(t))
    assert trend is not None and trend.slope == pytest.approx(0.1, rel=0.05)
    assert planned_rate(trend, rate, 120) == pytest.approx(rate + 0.1 * 120, rel=0.03)


def test_a_falling_rate_is_planned_at_the_rate_now() -> None:
    trend = None
    for t in range(0, 600, 15):
        trend = update(trend, 100 - 0.1 * t, float(t))
    assert trend is not None and trend.slope < 0
    now = 100 - 0.1 * 585
    assert planned_rate(trend, now, 120) == pytest.approx(max(now, trend.level))
    assert planned_rate(trend, now, 120) < 100 - 0.1 * 570  # not held at an older, higher level for long


def test_a_negative_lead_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="lead_s"):
        planned_rate(Trend(1.0, 0.0, 0.0), 1.0, -1)


@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=40), st.floats(0, 600))
def test_the_plan_is_never_below_the_measured_rate_and_grows_with_the_lead(rates: list[float], lead: float) -> None:
    trend = None
    for i, rate in enumerate(rates):
        trend = update(trend, rate, 15.0 * i)
    assert trend is not None
    assert planned_rate(trend, rates[-1], lead) >= rates[-1]
    assert planned_rate(trend, rates[-1], lead + 60) >= planned_rate(trend, rates[-1], lead)
