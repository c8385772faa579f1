"""The fleet optimizer (hpi_operator.fleet): hand-solvable cases, the per-replica model, and properties checked
against exhaustive search on small fleets."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpi_operator.fleet.optimizer import DEFAULT_UTILIZATION, PoolOffer, optimize
from hpi_operator.fleet.performance import Demand, PoolPerformance, Slo, replica_capacity

SLO = Slo(ttft_p90_s=1.0, itl_p90_s=0.1)
DEMAND = Demand(request_rate=10.0, mean_prompt_tokens=500, mean_output_tokens=200)
# Decode and prefill speeds of the shape hpi profile measures: a big GPU, a small GPU, a CPU.
BIG = PoolPerformance(itl_alpha_s=0.012, itl_beta_s=0.0002, prefill_tokens_per_s=20_000, max_num_seqs=256)
SMALL = PoolPerformance(itl_alpha_s=0.035, itl_beta_s=0.0008, prefill_tokens_per_s=4_000, max_num_seqs=48)
CPU = PoolPerformance(itl_alpha_s=0.04, itl_beta_s=0.002, prefill_tokens_per_s=300, max_num_seqs=16)


def rate(perf: PoolPerformance, demand: Demand = DEMAND, slo: Slo = SLO) -> float:
    return replica_capacity(perf, demand, slo).request_rate


def test_one_replica_stays_within_both_targets_at_its_capacity() -> None:
    cap = replica_capacity(SMALL, DEMAND, SLO)
    assert cap.meets_slo and cap.step_s <= SLO.itl_p90_s and cap.ttft_s <= SLO.ttft_p90_s
    # One more sequence would break the ITL target: the capacity is the largest batch that keeps it.
    assert replica_capacity(SMALL, DEMAND, Slo(1.0, cap.step_s * 0.999)).batch < cap.batch
    assert rate(SMALL, slo=Slo(1.0, 0.06)) < rate(SMALL)  # a tighter target, less traffic per replica


def test_the_cheapest_pool_per_request_that_meets_the_slo_wins() -> None:
    offers = [PoolOffer("big", BIG, cost_per_hour=10.0, max_replicas=10),
              PoolOffer("small", SMALL, cost_per_hour=0.5, max_replicas=50)]  # fmt: skip
    assert 10.0 / rate(BIG) > 0.5 / rate(SMALL)  # small is cheaper per request/s here
    plan = optimize(DEMAND, SLO, offers)
    assert plan.feasible and plan.replicas["big"] == 0
    assert plan.replicas["small"] == -(-DEMAND.request_rate / DEFAULT_UTILIZATION // rate(SMALL))
    # Priced the other way round, the big pool wins.
    flipped = optimize(DEMAND, SLO, [PoolOffer("big", BIG, 1.0, 10), PoolOffer("small", SMALL, 5.0, 50)])
    assert flipped.replicas == {"big": -(-DEMAND.request_rate / DEFAULT_UTILIZATION // rate(BIG)), "small": 0}


def test_a_full_pool_spills_to_the_next_cheapest() -> None:
    """The same hardware at two prices (a reserved pool and an on-demand one): the cheap one fills first."""
    needed = int(-(-DEMAND.request_rate / DEFAULT_UTILIZATION // rate(SMALL)))
    assert needed > 3
    offers = [PoolOffer("on-demand", SMALL, cost_per_hour=0.7, max_replicas=20),
              PoolOffer("reserved", SMALL, cost_per_hour=0.5, max_replicas=3)]  # fmt: skip
    plan = optimize(DEMAND, SLO, offers)
    assert plan.feasible and plan.replicas == {"reserved": 3, "on-demand": needed - 3}
    assert plan.capacity_rps * DEFAULT_UTILIZATION >= DEMAND.request_rate


def test_a_pool_too_slow_for_the_slo_is_not_used_while_fast_ones_suffice() -> None:
    offers = [PoolOffer("cpu", CPU, cost_per_hour=0.01, max_replicas=100), PoolOffer("small", SMALL, 0.5, 50)]
    plan = optimize(DEMAND, SLO, offers)
    assert plan.feasible and plan.replicas["cpu"] == 0
    assert not plan.capacities["cpu"].meets_slo and "prefill" in plan.capacities["cpu"].why_not


def test_infeasible_plans_say_why_and_do_their_best() -> None:
    short = optimize(DEMAND, SLO, [PoolOffer("small", SMALL, 0.5, 2), PoolOffer("cpu", CPU, 0.1, 5)])
    assert not short.feasible and short.reason.startswith("capacity:")
    assert short.replicas == {"small": 2, "cpu": 5}  # every fast replica, and the slow ones for the rest
    assert "small" in short.reason and "cpu:" in short.reason
    none_fast = optimize(DEMAND, SLO, [PoolOffer("cpu", CPU, 0.1, 100)])
    assert not none_fast.feasible and none_fast.reason.startswith("no pool fast enough: cpu:")
    assert 0 < none_fast.replicas["cpu"] < 100  # the demand's worth of slow replicas, not all of them


def test_slow_pools_take_only_what_the_fast_ones_cannot_carry_at_full_use() -> None:
    per_replica = optimize(DEMAND, SLO, [PoolOffer("small", SMALL, 0.5, 1)]).capacities["small"].request_rate
    # Two small replicas carry the demand at full use but not with the planned headroom (DEFAULT_UTILIZATION).
    demand = Demand(1.9 * per_replica, DEMAND.mean_prompt_tokens, DEMAND.mean_output_tokens)
    plan = optimize(demand, SLO, [PoolOffer("small", SMALL, 0.5, 2), PoolOffer("cpu", CPU, 0.1, 5)])
    assert not plan.feasible and plan.replicas == {"small": 2, "cpu": 0}
    more = Demand(2.5 * per_replica, DEMAND.mean_prompt_tokens, DEMAND.mean_output_tokens)
    spilled = optimize(more, SLO, [PoolOffer("small", SMALL, 0.5, 2), PoolOffer("cpu", CPU, 0.1, 50)])
    cpu_rate = spilled.capacities["cpu"].request_rate
    assert spilled.replicas["small"] == 2
    overflow = 0.5 * per_replica / DEFAULT_UTILIZATION  # the overflow alone goes to the slow pool
    assert spilled.replicas["cpu"] == math.ceil(overflow / cpu_rate - 1e-9)


def test_zero_demand_keeps_each_pools_minimum() -> None:
    idle = Demand(request_rate=0.0, mean_prompt_tokens=500, mean_output_tokens=200)
    plan = optimize(idle, SLO, [PoolOffer("big", BIG, 10.0, 10, min_replicas=1), PoolOffer("small", SMALL, 0.5, 9)])
    assert plan.replicas == {"big": 1, "small": 0} and plan.feasible


@pytest.mark.parametrize(
    "bad",
    [lambda: PoolPerformance(0, 0, 100, 4), lambda: PoolPerformance(0.01, 0.001, 0, 4),
     lambda: PoolPerformance(0.01, 0.001, 100, 0), lambda: PoolPerformance(0.01, 0.001, 100, 4, source="guess"),
     lambda: Slo(0, 0.1), lambda: Demand(-1, 10, 10), lambda: PoolOffer("p", SMALL, -1.0, 3),
     lambda: optimize(DEMAND, SLO, [PoolOffer("p", SMALL, 1, 3), PoolOffer("p", BIG, 1, 3)]),
     lambda: optimize(DEMAND, SLO, [PoolOffer("p", SMALL, 1, 3)], utilization=0)],
)  # fmt: skip
def test_bad_input_is_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError):
        bad()  # type: ignore[operator]


perfs = st.builds(
    PoolPerformance,
    itl_alpha_s=st.floats(0.005, 0.08), itl_beta_s=st.floats(0.0001, 0.004),
    prefill_tokens_per_s=st.floats(300, 30_000), max_num_seqs=st.integers(1, 128),
)  # fmt: skip
offers = st.lists(st.tuples(perfs, st.floats(0.05, 20.0), st.integers(0, 6), st.integers(0, 2)), min_size=1,
                  max_size=3)  # fmt: skip
demands = st.builds(Demand, request_rate=st.floats(0, 30), mean_prompt_tokens=st.floats(0, 2000),
                    mean_output_tokens=st.floats(1, 600))  # fmt: skip


def _offers(raw: list[tuple[PoolPerformance, float, int, int]]) -> list[PoolOffer]:
    return [PoolOffer(f"p{i}", perf, cost, max_r + min_r, min_r) for i, (perf, cost, max_r, min_r) in enumerate(raw)]


@settings(max_examples=60, deadline=None)
@given(raw=offers, demand=demands)
def test_plans_are_within_bounds_and_as_cheap_as_exhaustive_search(raw: list, demand: Demand) -> None:
    pools = _offers(raw)
    plan = optimize(demand, SLO, pools)
    for pool in pools:
        assert pool.min_replicas <= plan.replicas[pool.name] <= pool.max_replicas
    if plan.feasible:
        assert plan.capacity_rps + 1e-6 >= demand.request_rate / DEFAULT_UTILIZATION
    # Exhaustive search over every replica vector: no cheaper one covers the demand within the SLO.
    caps = {p.name: replica_capacity(p.performance, demand, SLO) for p in pools}
    cheapest = None
    for counts in itertools.product(*(range(p.min_replicas, p.max_replicas + 1) for p in pools)):
        paired = list(zip(pools, counts, strict=True))
        covered = sum(caps[p.name].request_rate * n for p, n in paired if caps[p.name].meets_slo)
        if covered + 1e-9 >= demand.request_rate / DEFAULT_UTILIZATION:
            cost = sum(p.cost_per_hour * n for p, n in paired)
            cheapest = cost if cheapest is None else min(cheapest, cost)
    assert plan.feasible == (cheapest is not None)
    if cheapest is not None:
        assert plan.cost_per_hour <= cheapest + 1e-6


@settings(max_examples=40, deadline=None)
@given(raw=offers, demand=demands, more=st.floats(0, 20))
def test_more_demand_never_costs_less(raw: list, demand: Demand, more: float) -> None:
    pools = _offers(raw)
    higher = Demand(demand.request_rate + more, demand.mean_prompt_tokens, demand.mean_output_tokens)
    low, high = optimize(demand, SLO, pools), optimize(higher, SLO, pools)
    if low.feasible and high.feasible:
        assert high.cost_per_hour + 1e-6 >= low.cost_per_hour
        assert high.capacity_rps + 1e-6 >= higher.request_rate / DEFAULT_UTILIZATION
