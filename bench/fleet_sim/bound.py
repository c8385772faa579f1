"""A floor under the headline day's cost within the SLO: what a fleet that is always exactly big enough costs.

For each demand level (a fraction of the day's peak), steady Poisson traffic with the day's token mix runs on a
fixed fleet that starts warm: the fleet is the optimizer's plan for `multiplier` x the level's rate at full use
(its cheapest pools first: every H200, then L4s), and a binary search finds the smallest multiplier whose
requests (after a warm-up) are within the SLO at least `ATTAINMENT` of the time. The day's floor is then the
cost of running, at every moment, the fleet its rate needs (linear between the measured levels), with no cold
start, no forecast error, no scale-down delay: no controller with these pools, router and SLO does better on
this day except by letting some stretch of the day fall below the attainment target to pay for another.

A cost target below this floor cannot be met by any autoscaling on this fleet; the gap between a controller's
cost and the floor is what a better controller could still win.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hpi_operator.fleet.optimizer import PoolOffer, optimize, pools_meeting_slo
from hpi_operator.fleet.performance import Demand, Slo, replica_capacity

from .engine import RunConfig, Simulation
from .metrics import within
from .pools import SimPool
from .scaling import FixedControl
from .workloads import Arrivals, LengthMix, generate

ATTAINMENT = 0.99
STEADY_S = 480.0  # each probe's run; the first WARMUP_S are not counted (the fleet fills up)
WARMUP_S = 120.0
PRECISION = 0.015  # the search stops when the multiplier is known to this (relative)


@dataclass(frozen=True)
class Level:
    rate_rps: float
    multiplier: float  # planned rate / actual rate at the smallest fleet found within the SLO
    replicas: dict[str, int]
    cost_per_hour: float
    attainment: float
    probes: int


def _plan(pools: Sequence[SimPool], context: float, mix: LengthMix, rate: float, slo: Slo) -> dict[str, int]:
    """The optimizer's fleet for `rate` at full use, on the pools that can meet the SLO only (a request sent to one
    that cannot is a miss, so a floor never uses one); beyond what they carry, all of them at their capacity."""
    prompt, output = mix.mean_tokens()
    demand = Demand(rate, prompt, output)
    offers = [PoolOffer(p.name, p.performance_at(context), p.cost_per_hour, p.max_replicas) for p in pools]
    fast = set(pools_meeting_slo(offers, demand, slo))
    plan = optimize(demand, slo, [o for o in offers if o.name in fast], utilization=1.0)
    if not plan.feasible:
        return {p.name: p.max_replicas if p.name in fast else 0 for p in pools}
    return {p.name: plan.replicas.get(p.name, 0) for p in pools}


def slo_batches(pools: Sequence[SimPool], context: float, mix: LengthMix, slo: Slo) -> dict[str, int]:
    """The SLO batch of each pool, as the optimizer plans it and the router shares load by (scaling.py)."""
    prompt, output = mix.mean_tokens()
    demand = Demand(1.0, prompt, output)  # a replica's capacity depends on the token mix, not on the rate
    return {p.name: replica_capacity(p.performance_at(context), demand, slo).slo_max_num_seqs for p in pools}


def steady_attainment(pools: Sequence[SimPool], replicas: dict[str, int], rate: float, mix: LengthMix, slo: Slo,
                      seed: int, context: float, steady_s: float = STEADY_S) -> float:  # fmt: skip
    """The share of requests arriving after the warm-up (a quarter of `steady_s`, WARMUP_S at the default) that are
    within `slo`, on a fixed warm fleet whose router shares load by the plan's SLO batches at `context`."""
    requests = generate(Arrivals("poisson", rate, steady_s), mix, seed)
    control = FixedControl(replicas, slo_batches=slo_batches(pools, context, mix, slo))
    config = RunConfig(pools=pools, requests=requests, control=control, initial_replicas=replicas,
                       duration_s=steady_s, slo=slo)  # fmt: skip
    result = Simulation(config).run()
    counted = [r for r in result.results if r.arrival_s >= steady_s * WARMUP_S / STEADY_S]  # the run drains
    total = len(counted) + result.num_unserved  # none is unserved on a fixed warm fleet; if one were, a miss
    return sum(1 for r in counted if within(r, slo)) / total if total else 1.0


def level(pools: Sequence[SimPool], context: float, mix: LengthMix, rate: float, slo: Slo, seed: int,
          low: float = 1.0, high: float = 1.35, steady_s: float = STEADY_S) -> Level:  # fmt: skip
    """The smallest fleet (by planned-rate multiplier in [low, high]) within the SLO at `rate`."""
    costs = {p.name: p.cost_per_hour for p in pools}
    probes = 0
    while True:
        replicas = _plan(pools, context, mix, rate * high, slo)
        attained = steady_attainment(pools, replicas, rate, mix, slo, seed, context, steady_s)
        probes += 1
        if attained >= ATTAINMENT:
            break
        if replicas == _plan(pools, context, mix, rate * high * 1.25, slo):  # every SLO pool full: no fleet holds it
            raise ValueError(f"no fleet of these pools holds {rate:g} req/s within the SLO {ATTAINMENT:.0%} of time")
        low, high = high, high * 1.25  # even the upper end misses: widen
    best = Level(rate, high, replicas, sum(costs[k] * n for k, n in replicas.items()), attained, probes)
    while high / low > 1 + PRECISION:
        mid = math.sqrt(low * high)
        replicas = _plan(pools, context, mix, rate * mid, slo)
        if replicas == best.replicas:  # the same fleet: nothing between mid and high is smaller
            high = mid
            continue
        attained = steady_attainment(pools, replicas, rate, mix, slo, seed, context, steady_s)
        probes += 1
        if attained >= ATTAINMENT:
            high = mid
            best = Level(rate, mid, replicas, sum(costs[k] * n for k, n in replicas.items()), attained, probes)
        else:
            low = mid
    return replace(best, probes=probes)


def start_cost(levels: Sequence[Level], pools: Sequence[SimPool]) -> float:
    """Dollars the floor's own fleet pays to start on the day: a replica is paid for while it starts (fleet.py), and
    every replica the floor runs at its peak level beyond its lowest one must be started once, its pool's cold start
    before it serves. Added to `day_floor`, the floor of a controller that pays for starts as every real one does
    (a drained replica's last requests, which it also pays for, are left out: still a floor)."""
    ordered = sorted(levels, key=lambda x: x.rate_rps)
    total = 0.0
    for pool in pools:
        counts = [x.replicas.get(pool.name, 0) for x in ordered]
        total += (max(counts) - counts[0]) * pool.cold_start_s / 3600 * pool.cost_per_hour
    return total


def day_floor(levels: Sequence[Level], arrivals: Arrivals, step_s: float = 1.0) -> float:
    """Dollars for the day at each moment's fleet cost, linear in the rate between the measured levels (the rate
    is the diurnal curve's; below the lowest level, that level's cost)."""
    ordered = sorted(levels, key=lambda x: x.rate_rps)
    rates = [x.rate_rps for x in ordered]
    total = 0.0
    for i in range(int(arrivals.duration_s / step_s)):
        r = arrivals.diurnal_rate((i + 0.5) * step_s)
        j = min(max(sum(1 for x in rates if x <= r) - 1, 0), len(ordered) - 2)
        a, b = ordered[j], ordered[j + 1]
        f = min(max((r - a.rate_rps) / (b.rate_rps - a.rate_rps), 0.0), 1.0)
        total += (a.cost_per_hour + f * (b.cost_per_hour - a.cost_per_hour)) * step_s / 3600
    return total
