"""The demand the optimizer plans for on a rise (fleet/forecast.py): Holt's linear trend, rising slopes only, never
below the rate measured now, planned as far ahead as the pools take to start. Hand-solvable cases and the
properties that keep it from flapping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpi_operator.fleet.forecast import (
    ASSUMED_START_S,
    LAG_POLLS,
    LEVEL_SMOOTHING,
    MAX_LEAD_S,
    REFERENCE_POLL_S,
    TREND_SMOOTHING,
    Lead,
    Trend,
    lead_time,
    planned_rate,
    start_times,
    update,
    weight,
)


def test_the_first_reading_is_the_level_with_no_slope() -> None:
    trend = update(None, 10.0, 100.0)
    assert trend == Trend(10.0, 0.0, 100.0)
    assert planned_rate(trend, 10.0, 120) == 10.0


def test_one_step_by_hand() -> None:
    assert REFERENCE_POLL_S == 15
    trend = update(Trend(10.0, 0.0, 0.0), 20.0, 15.0)
    level = LEVEL_SMOOTHING * 20 + (1 - LEVEL_SMOOTHING) * 10  # 15
    slope = TREND_SMOOTHING * (level - 10) / 15  # 0.0667 req/s per s
    assert trend.level == pytest.approx(level) and trend.slope == pytest.approx(slope)
    assert planned_rate(trend, 20.0, 120) == pytest.approx(max(20.0, level + slope * 120))  # 23


def test_the_smoothing_is_per_second_not_per_poll() -> None:
    """Two polls 7.5 s apart leave the same level as one poll 15 s later at the same rate, and a 1 s poll's
    noise reaches the plan no more than a 15 s poll's does: a slope of noise is not extrapolated 150x."""
    assert weight(LEVEL_SMOOTHING, 15.0) == pytest.approx(LEVEL_SMOOTHING)
    one = update(Trend(10.0, 0.0, 0.0), 20.0, 15.0)
    two = update(update(Trend(10.0, 0.0, 0.0), 20.0, 7.5), 20.0, 15.0)
    assert two.level == pytest.approx(one.level, rel=0.05)
    plans = {}
    for poll_s in (1.0, 15.0):
        trend, t = None, 0.0
        for i in range(int(600 / poll_s)):
            trend = update(trend, 12.0 * (1.01 if i % 2 else 0.99), t)  # a steady 12 req/s, read +-1%
            t += poll_s
        assert trend is not None
        plans[poll_s] = planned_rate(trend, 12.12, 150 + 2 * poll_s)
    assert plans[1.0] <= plans[15.0] * 1.01 and plans[1.0] < 12.12 * 1.03


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


def test_the_lead_is_the_slowest_fast_enough_pools_start_plus_two_polls() -> None:
    starts = {"h200": 90.0, "l4": 120.0, "cpu": 180.0}
    assert LAG_POLLS == 2
    # The CPU pool starts slowest but cannot meet the SLO, so the caller leaves it out of `pools`.
    assert lead_time(None, starts, ["h200", "l4"], 15) == Lead(150.0, "measured", "l4", 120.0)
    assert lead_time(None, starts, ["h200"], 15) == Lead(120.0, "measured", "h200", 90.0)
    # A pool no pod of which has been seen starting is assumed to take ASSUMED_START_S.
    assert lead_time(None, {"l4": 60.0}, ["l4", "new"], 10) == Lead(ASSUMED_START_S + 20, "assumed", "new",
                                                                    ASSUMED_START_S)  # fmt: skip
    assert lead_time(None, {}, [], 15) == Lead(ASSUMED_START_S + 30, "assumed", None, ASSUMED_START_S)
    # A "start" of an hour is a pod that waited for a node: the trend is not projected that far.
    assert lead_time(None, {"l4": 3600.0}, ["l4"], 15).seconds == MAX_LEAD_S
    # spec.autoscaling.leadTimeSeconds wins, 0 included.
    assert lead_time(0, starts, ["l4"], 15) == Lead(0.0, "spec")
    with pytest.raises(ValueError, match="poll_s"):
        lead_time(None, starts, ["l4"], -1)


def test_a_pools_start_time_is_its_ready_pods_p90_and_is_remembered_while_it_has_none() -> None:
    seen = {"l4": [100.0 + i for i in range(10)], "h200": [], "cpu": [200.0]}
    out = start_times(seen, {"h200": 95.0, "l4": 1.0, "gone": 70.0})
    assert out == {"l4": 108.0, "h200": 95.0, "cpu": 200.0, "gone": 70.0}  # nearest rank: the 9th of 10


@given(st.dictionaries(st.sampled_from("abcd"), st.floats(0, 1e4)), st.lists(st.sampled_from("abcde")),
       st.floats(0, 300))  # fmt: skip
def test_the_lead_never_shrinks_when_a_pool_starts_slower(starts: dict, pools: list, poll_s: float) -> None:
    lead = lead_time(None, starts, pools, poll_s)
    assert min(LAG_POLLS * poll_s, MAX_LEAD_S) <= lead.seconds <= MAX_LEAD_S
    for pool in pools:
        slower = {**starts, pool: starts.get(pool, ASSUMED_START_S) + 60}
        assert lead_time(None, slower, pools, poll_s).seconds >= lead.seconds
