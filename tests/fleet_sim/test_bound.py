"""The cost floor (bench/fleet_sim/bound.py): the day's integral is the hand-computable one, and the smallest fleet a
level finds holds the SLO while the next smaller plan it tried does not."""

from __future__ import annotations

import math

import pytest
from fleet_sim.bound import ATTAINMENT, Level, _plan, day_floor, level, start_cost, steady_attainment
from fleet_sim.pools import headline_pools
from fleet_sim.workloads import AZURE_CONV_2023, Arrivals

from hpi_operator.fleet.performance import Slo

SLO = Slo(2.0, 0.1)


def _level(rate: float, cost: float) -> Level:
    return Level(rate, 1.0, {}, cost, 1.0, 1)


def test_the_day_costs_the_integral_of_the_fleet_its_rate_needs():
    day = Arrivals("diurnal", 100.0, 3600.0, trough_fraction=0.2)
    # Cost linear in the rate ($0.5/h per req/s): the day's mean rate is 0.2 + 0.8 / 2 = 0.6 of the peak.
    floor = day_floor([_level(20.0, 10.0), _level(100.0, 50.0)], day)
    assert floor == pytest.approx(0.5 * 60.0 * 1.0, rel=1e-3)
    # A flat cost is that cost for the hour, whatever the rate does.
    assert day_floor([_level(20.0, 7.0), _level(100.0, 7.0)], day) == pytest.approx(7.0)


def test_the_floors_fleet_pays_to_start_what_it_adds_over_the_day():
    pools = headline_pools(1260.0)  # the H200 starts in 90 s at $6.305/h, the L4 in 120 s at $0.8048/h
    night, noon = (Level(r, 1.0, replicas, 0.0, 1.0, 1) for r, replicas in
                   ((68.0, {"h200-bf16": 4, "l4-int8": 6}), (340.0, {"h200-bf16": 8, "l4-int8": 368})))  # fmt: skip
    expected = 4 * 90 / 3600 * 6.305 + 362 * 120 / 3600 * 0.8048
    assert start_cost([noon, night], pools) == pytest.approx(expected)
    assert start_cost([night, night], pools) == 0.0  # a flat day starts nothing


def test_a_level_finds_a_fleet_within_the_slo_and_the_smaller_plans_miss():
    context = sum(AZURE_CONV_2023.mean_tokens()) - AZURE_CONV_2023.mean_tokens()[1] / 2
    pools = headline_pools(context, h200_max=0, l4_max=40, cpu_max=0)
    rate, steady_s = 5.0, 240.0  # about eight L4s; short runs keep the test quick
    found = level(pools, context, AZURE_CONV_2023, rate, SLO, seed=3, steady_s=steady_s)
    assert found.attainment >= ATTAINMENT and found.multiplier >= 1.0
    assert found.replicas["l4-int8"] >= 2 and found.replicas["h200-bf16"] == 0
    smaller = _plan(pools, context, AZURE_CONV_2023, rate * found.multiplier / 1.1, SLO)
    if smaller != found.replicas:  # 10% less planned rate is a smaller fleet: it must miss, or the search was wrong
        assert sum(smaller.values()) < sum(found.replicas.values())
        assert steady_attainment(pools, smaller, rate, AZURE_CONV_2023, SLO, 3, context, steady_s) < ATTAINMENT
    assert math.isfinite(found.cost_per_hour) and found.cost_per_hour > 0
