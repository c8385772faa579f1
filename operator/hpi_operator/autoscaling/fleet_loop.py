"""One poll of the fleet optimizer (autoscaling mode optimizer), between the kopf timer and the pure parts:

scraped pod loads + the memory on the resource -> demand (fleet/demand.py) -> the serving pools as offers
(fleet/offers.py) -> the cheapest replicas per pool that meet spec.slo (fleet/optimizer.py) -> stabilized per
pool (fleet/stabilize.py, the autoscaling windows and step) -> status.autoscaling.optimizer, which the plan runs;
beside it, the SLO attainment the pods' latency histograms show since the last poll (fleet/attainment.py).
Everything here is a pure function of its arguments; handlers.py scrapes, writes and posts the Events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..fleet.attainment import ObservedSlo, describe, histograms_to_status, observed_to_status, read_latency
from ..fleet.demand import read_demand
from ..fleet.forecast import LAG_POLLS, Lead, falling, lead_time, planned_rate, start_times, update
from ..fleet.offers import pool_offers
from ..fleet.optimizer import FleetPlan, PoolOffer, optimize, pools_meeting_slo
from ..fleet.performance import Demand, PoolPerformance
from ..fleet.pricing import LabelPrice, NodePrices, label_price
from ..fleet.stabilize import Window, stabilize_all
from ..placement import eligible_choices, rank_choices
from ..plan import Plan
from .decision import PodLoad
from .fleet_status import optimizer_memory, trend_to_status
from .loop import rfc3339


@dataclass(frozen=True)
class FleetPoll:
    replicas: dict[str, int]  # per pool, stabilized: what the plan runs next
    changed: bool
    feasible: bool
    message: str  # the decision explained
    status: dict[str, Any]  # merged into status.autoscaling.optimizer


def _explain(before: Mapping[str, int], after: Mapping[str, int], demand: Demand, planned: Demand, lead: Lead,
             plan: FleetPlan, left_out: Mapping[str, str], recommended: Mapping[str, int], itl_ms: float,
             observed: ObservedSlo | None, sources: Mapping[str, str]) -> str:  # fmt: skip
    moves = ", ".join(f"{p} {before.get(p, 0)} -> {n}" for p, n in after.items() if before.get(p, 0) != n)
    head = moves or "no change"
    rising = (f", rising: planned for {planned.request_rate:.2f} req/s in {lead.seconds:.0f} s ({_why(lead)})"
              if planned.request_rate > demand.request_rate + 1e-9 else "")  # fmt: skip
    parts = [f"{head}: demand {demand.request_rate:.2f} req/s ({demand.mean_prompt_tokens:.0f} prompt, "
             f"{demand.mean_output_tokens:.0f} output tokens){rising}"]  # fmt: skip
    for pool, cap in plan.capacities.items():
        want = recommended.get(pool, 0)
        figures = f"{sources.get(pool, 'unknown')} figures"  # measured, assumed or override: how far to trust it
        if cap.meets_slo and want:
            parts.append(f"{pool} x{want} at {cap.request_rate:.2f} req/s each within itlP90 {itl_ms:.0f} ms "
                         f"({figures})")  # fmt: skip
        elif not cap.meets_slo:
            parts.append(f"{pool} misses the SLO ({cap.why_not}; {figures})")
    parts += [f"{pool} left out ({why})" for pool, why in left_out.items()]
    if not plan.feasible:
        parts.append(f"SLO not attainable: {plan.reason}")
    held = [p for p, n in after.items() if n != recommended.get(p, n)]
    if held:
        parts.append(f"held by the stabilization window or step: {', '.join(held)}")
    if observed is not None:
        parts.append(describe(observed))
    return "; ".join(parts)


def _why(lead: Lead) -> str:
    if lead.source == "spec":
        return "leadTimeSeconds"
    pool = f"{lead.pool} starts" if lead.pool else "a pod starts"
    return f"{pool} in {lead.start_s:.0f} s ({lead.source}) + {LAG_POLLS} polls"


def fleet_poll(plan: Plan, loads: Sequence[PodLoad], status: Mapping[str, Any], current: Mapping[str, int],
               now_s: float, prices: NodePrices | None = None, starts: Mapping[str, Sequence[float]] | None = None,
               num_router_queued: int = 0) -> FleetPoll:  # fmt: skip
    """Decide replicas per pool for `plan` (its spec in optimizer mode) from this poll's pod loads; `prices`: the
    nodes' price labels, for pools whose spec sets no costPerHour; `starts`: per pool, the start times (creation
    to Ready) of its ready pods, for the lead time when the spec sets none; `num_router_queued`: the requests the
    router pods hold (router_queue.py), which no pod's counters show while no pod is ready."""
    spec = plan.spec
    assert spec.slo is not None and plan.shape is not None  # parse_spec and make_plan guarantee both
    memory = optimizer_memory(status)
    reading = read_demand(loads, memory.counters, memory.at_s, now_s, memory.mix)
    trend = update(memory.trend, reading.demand.request_rate, now_s) if reading.measured else memory.trend
    window_s = now_s - memory.at_s if memory.at_s is not None else None
    latency = read_latency(loads, memory.histograms, window_s, spec.slo)
    serving = rank_choices(eligible_choices(plan.choices, spec.placement.allowed_pools), spec.placement.preferred_pools)
    label_prices = {c.pool.name: label_price(c.pool, c.profile, prices) for c in serving
                    if prices is not None and c.profile is not None}  # fmt: skip
    measured = {pool: PoolPerformance.from_profile(profile) for pool, profile in plan.measured.items()}
    # The offers depend on the demand's token mix only, which the planned demand shares with the measured one.
    offered = pool_offers(spec, serving, plan.shape, reading.demand, label_prices=label_prices, measured=measured)
    start_s = start_times(starts or {}, memory.start_s)
    fast_enough = pools_meeting_slo(offered.offers, reading.demand, spec.slo)
    lead = lead_time(spec.autoscaling.lead_time_s, start_s, fast_enough, spec.autoscaling.poll_interval_s)
    planned = reading.demand
    if trend is not None:
        planned = replace(planned, request_rate=planned_rate(trend, planned.request_rate, lead.seconds))
    fleet = optimize(planned, spec.slo, offered.offers, spec.autoscaling.target_capacity_utilization)
    recommended = {pool: fleet.replicas.get(pool, low) for pool, (low, _) in offered.bounds.items()}
    settings = spec.autoscaling
    _floor_total(recommended, settings.min_replicas, offered.bounds, fleet, offered.offers)
    # By default the lead (what a released replica takes to return), two polls while the demand falls.
    down_s = settings.scale_down_window_s(lead.seconds, falling(trend, reading.demand.request_rate, lead.seconds))
    window = Window(settings.scale_up_stabilization_s, down_s, settings.max_scale_step)
    if not reading.measured:  # the first poll only starts the counters: keep what runs
        recommended = {pool: current.get(pool, 0) for pool in recommended}
    if num_router_queued > 0:
        # Requests held in the router are demand with no pod to measure it from (a fleet at zero has no counters):
        # never zero replicas while they wait, even on a first poll. The floor goes to the cheapest pool within the
        # SLO, as minReplicas does; once a pod serves, its counters measure the demand as usual.
        _floor_total(recommended, max(settings.min_replicas, 1), offered.bounds, fleet, offered.offers)
    replicas, histories = stabilize_all(current, recommended, memory.recommendations, offered.bounds, now_s, window)
    sources = {o.name: o.performance.source for o in offered.offers}
    message = _explain(current, replicas, reading.demand, planned, lead, fleet, offered.left_out,
                       recommended, spec.slo.itl_p90_s * 1e3, latency.observed, sources)  # fmt: skip
    if num_router_queued > 0:
        message += f"; {num_router_queued} request(s) queued in the router"
    demand = reading.demand
    status_patch = {
        "replicas": replicas,
        "recommended": recommended,
        "feasible": fleet.feasible,
        "reason": fleet.reason,
        "message": message,
        "time": rfc3339(now_s),
        "costPerHour": round(sum(o.cost_per_hour * replicas.get(o.name, 0) for o in offered.offers), 4),
        "demand": {"requestRate": round(demand.request_rate, 4),
                   "plannedRequestRate": round(planned.request_rate, 4),
                   "meanPromptTokens": round(demand.mean_prompt_tokens, 1),
                   "meanOutputTokens": round(demand.mean_output_tokens, 1)},  # fmt: skip
        "pools": {o.name: {"source": o.performance.source, "costPerHour": round(o.cost_per_hour, 6),
                           **_cost_source(spec.placement.pool(o.name).cost_per_hour, label_prices.get(o.name)),
                           "requestRatePerReplica": round(fleet.capacities[o.name].request_rate, 4),
                           "meetsSLO": fleet.capacities[o.name].meets_slo,
                           "sloMaxNumSeqs": fleet.capacities[o.name].slo_max_num_seqs}
                  for o in offered.offers},  # fmt: skip
        "leftOut": dict(offered.left_out) or None,
        "slo": None if latency.observed is None else observed_to_status(latency.observed),
        "recommendations": {p: [[round(at, 3), n] for at, n in recs] for p, recs in histories.items()},
        "counters": {pod: list(values) for pod, values in reading.counters.items()},
        "histograms": histograms_to_status(latency.histograms),
        "trend": None if trend is None else trend_to_status(trend),
        "leadTime": {"seconds": round(lead.seconds, 1), "source": lead.source, "pool": lead.pool},
        "scaleDownWindowSeconds": round(down_s, 1),
        "startSeconds": {pool: round(s, 1) for pool, s in sorted(start_s.items())} or None,
        "lastPollEpoch": round(now_s, 3),
        "tokenMix": [round(demand.mean_prompt_tokens, 2), round(demand.mean_output_tokens, 2)],
    }
    changed = any(replicas.get(p, 0) != current.get(p, 0) for p in replicas)
    return FleetPoll(replicas, changed, fleet.feasible, message, status_patch)


def _floor_total(recommended: dict[str, int], floor: int, bounds: Mapping[str, tuple[int, int]],
                 fleet: FleetPlan, offers: Sequence[PoolOffer]) -> None:  # fmt: skip
    """Never below autoscaling.minReplicas in all: the rest goes to the cheapest pool per request within the SLO
    that has room (a fleet with no demand still answers its first request without a cold start)."""
    costs = {o.name: o.cost_per_hour for o in offers}

    def price_per_request(pool: str) -> float:
        cap = fleet.capacities.get(pool)
        if cap is None or not cap.meets_slo or cap.request_rate <= 0:
            return float("inf")
        return costs[pool] / cap.request_rate

    for pool in sorted(recommended, key=price_per_request):
        while sum(recommended.values()) < floor and recommended[pool] < bounds[pool][1]:
            recommended[pool] += 1


def _cost_source(spec_cost: float | None, label: LabelPrice | None) -> dict[str, Any]:
    """Where a pool's price came from, and the node labels that could not be used (an offered pool's price is the
    spec's or, failing that, its labels')."""
    if spec_cost is not None:
        return {"costSource": "spec"}
    out: dict[str, Any] = {"costSource": "nodeLabel"}
    if label is not None:
        out["pricedNodes"] = label.num_priced_nodes
        if label.ignored:
            out["ignoredPrices"] = list(label.ignored)
    return out
