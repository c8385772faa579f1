"""Replicas per pool at the lowest cost that meets the SLO: a small MILP.

    minimise   sum_p cost_p * x_p
    subject to sum_p mu_p * x_p >= demand / utilization     (mu_p: one replica's rate within the SLO)
               min_p <= x_p <= max_p, x_p integer            (max_p: whole replicas the pool's nodes hold)

Pools that cannot meet the SLO at any load are held at their minimum. When the fast pools together cannot
carry the demand with the planned headroom, the plan says so (reason "capacity") and does the best it can: every
fast pool at its maximum, and only the demand they cannot carry even at full use, at the lowest cost, on the
pools that miss the SLO (served slowly beats not served, but each request sent there misses the SLO).
Solved with HiGHS through scipy.optimize.milp, chosen over highspy's own API by measurement
(bench/results/fleet_optimizer.md: 8 ms against 18 ms median at 10 pools on 2 cores).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from .performance import Demand, PoolPerformance, ReplicaCapacity, Slo, replica_capacity

# Plan for this fraction of each replica's capacity: headroom for bursts, and for the requests the capacity model's
# 90th percentiles leave out. The default of the CRD's spec.autoscaling.targetCapacityUtilization, which the
# operator passes (tests/operator/test_fleet_loop.py holds the two equal). 0.9: on the fleet simulator's day it
# holds 99.24% / 99.37% of requests within the SLO with the H200 estimated / measured, with the router sharing
# load by the planned SLO batches (and correcting slow replicas online) and the scale-down window two polls on a
# falling trend; 0.92 held 99.05% / 99.22%, too thin a margin for a default (bench/results/fleet.md; 0.82 before
# those two, when the router filled the slow pools past their plan).
DEFAULT_UTILIZATION = 0.9


@dataclass(frozen=True)
class PoolOffer:
    """One pool as the optimizer sees it."""

    name: str
    performance: PoolPerformance
    cost_per_hour: float  # per replica
    max_replicas: int  # capacity: whole replicas the pool's allocatable nodes hold
    min_replicas: int = 0

    def __post_init__(self) -> None:
        if self.cost_per_hour < 0:
            raise ValueError(f"pool {self.name}: cost_per_hour must be >= 0, got {self.cost_per_hour}")
        if not 0 <= self.min_replicas <= max(self.max_replicas, self.min_replicas):
            raise ValueError(f"pool {self.name}: min_replicas must be >= 0")


@dataclass(frozen=True)
class FleetPlan:
    replicas: Mapping[str, int]
    cost_per_hour: float
    capacity_rps: float  # requests/s the plan sustains within the SLO (at full use of each replica)
    feasible: bool  # the SLO is met for the whole demand
    reason: str | None = None  # why not: "capacity: ..." or "no pool fast enough: ..."
    capacities: Mapping[str, ReplicaCapacity] = field(default_factory=dict)  # one replica of each pool


def _solve(rates: Sequence[float], costs: Sequence[float], lows: Sequence[int], highs: Sequence[int],
           needed: float) -> list[int] | None:  # fmt: skip
    """The cheapest integer x in [lows, highs] with sum(rates * x) >= needed; None if even highs fall short."""
    if sum(r * h for r, h in zip(rates, highs, strict=True)) < needed - 1e-9:
        return None
    if needed <= sum(r * low for r, low in zip(rates, lows, strict=True)) + 1e-9:
        return list(lows)
    result = milp(
        c=np.asarray(costs, dtype=float),
        constraints=LinearConstraint(np.asarray([rates], dtype=float), lb=needed, ub=np.inf),
        integrality=np.ones(len(rates)),
        bounds=Bounds(np.asarray(lows, dtype=float), np.asarray(highs, dtype=float)),
    )
    if result.x is None:  # HiGHS found no integer point although the bounds allow one: numerically degenerate
        return list(highs)
    return [round(v) for v in result.x]


def pools_meeting_slo(offers: Sequence[PoolOffer], demand: Demand, slo: Slo) -> list[str]:
    """The offered pools one replica of which can serve `demand`'s token mix within `slo` at some load (the ones
    the plan may grow; forecast.lead_time plans as far ahead as the slowest of them starts)."""
    return [o.name for o in offers if replica_capacity(o.performance, demand, slo).meets_slo]


def optimize(
    demand: Demand, slo: Slo, offers: Sequence[PoolOffer], utilization: float = DEFAULT_UTILIZATION
) -> FleetPlan:
    """The cheapest replicas per pool whose capacity within `slo` covers `demand`."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if len({o.name for o in offers}) != len(offers):
        raise ValueError("pool names must be unique")
    caps = {o.name: replica_capacity(o.performance, demand, slo) for o in offers}
    needed = demand.request_rate / utilization
    fast = [o for o in offers if caps[o.name].meets_slo and o.max_replicas > o.min_replicas]
    slow = [o for o in offers if o not in fast]
    lows = {o.name: o.min_replicas for o in offers}
    # The minimum replicas of every pool count, the fast pools' toward the SLO capacity.
    floor_rate = sum(caps[o.name].request_rate * o.min_replicas for o in slow if caps[o.name].meets_slo)
    chosen = _solve([caps[o.name].request_rate for o in fast], [o.cost_per_hour for o in fast],
                    [o.min_replicas for o in fast], [o.max_replicas for o in fast],
                    max(needed - floor_rate, 0.0))  # fmt: skip
    replicas = dict(lows)
    reason = None
    if chosen is not None:
        replicas.update(zip((o.name for o in fast), chosen, strict=True))
    else:
        replicas.update({o.name: o.max_replicas for o in fast})
        within = sum(caps[o.name].request_rate * replicas[o.name] for o in offers if caps[o.name].meets_slo)
        # The SLO pools carry all they can, their headroom included: every request sent to a pool that misses the
        # SLO misses it, so the slow pools only take what the fast ones cannot carry even at full use (with
        # headroom on that part, so that their own queues stay bounded).
        rest = max(demand.request_rate - within, 0.0) / utilization
        usable = [o for o in slow if o.max_replicas > o.min_replicas]
        extra = _solve([caps[o.name].request_rate for o in usable], [o.cost_per_hour for o in usable],
                       [o.min_replicas for o in usable], [o.max_replicas for o in usable], rest)  # fmt: skip
        replicas.update(zip((o.name for o in usable), extra or [o.max_replicas for o in usable], strict=True))
        reason = _why_short(demand, offers, caps, within * utilization)
    within_slo = sum(caps[o.name].request_rate * replicas[o.name] for o in offers if caps[o.name].meets_slo)
    cost = sum(o.cost_per_hour * replicas[o.name] for o in offers)
    return FleetPlan(replicas, cost, within_slo, reason is None, reason, caps)


def _why_short(demand: Demand, offers: Sequence[PoolOffer], caps: Mapping[str, ReplicaCapacity],
               served: float) -> str:  # fmt: skip
    slow = "; ".join(f"{o.name}: {caps[o.name].why_not}" for o in offers if not caps[o.name].meets_slo)
    if not any(caps[o.name].meets_slo for o in offers):
        return f"no pool fast enough: {slow}"
    full = ", ".join(f"{o.name} ({o.max_replicas} replicas)" for o in offers if caps[o.name].meets_slo)
    text = f"capacity: {full} at their maximum carry {served:.1f} of {demand.request_rate:.1f} req/s within the SLO"
    return f"{text} ({slow})" if slow else text
