"""The controllers the simulated fleet runs, each a thin shell over the operator's own pure decisions:

- `OptimizerControl`: the fleet optimizer's poll in the order autoscaling/fleet_loop.py composes it: the pods'
  counters -> `read_demand` -> each pool's offer at the demand's mean context -> the lead time (`lead_time`, from
  the ready replicas' start times unless one is set) -> `optimize` -> `stabilize_all` (the autoscaling windows
  and step), with the memory carried from poll to poll as the operator keeps it in status. Pool bounds:
  [0, the pool's capacity].
- `KvControl`: today's baseline: the builtin KV-utilisation autoscaler's `decide` on the total, then rank-fill
  placement (`rank_choices` + `spread_replicas`) over the pools.
- `FixedControl`: replicas that never change (the routing comparison).
Each `poll(members, current, now_s)` sees the ready replicas and the current replicas per pool (starting or
ready) and returns the replicas per pool it wants.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from hpi_operator.autoscaling.decision import History, Observation, PodLoad, decide
from hpi_operator.fleet.demand import Counters, read_demand
from hpi_operator.fleet.forecast import Lead, Trend, falling, lead_time, planned_rate, start_times, update
from hpi_operator.fleet.optimizer import DEFAULT_UTILIZATION, PoolOffer, optimize, pools_meeting_slo
from hpi_operator.fleet.performance import Demand, Slo
from hpi_operator.fleet.stabilize import Recommendations, Window, stabilize_all
from hpi_operator.placement import Slot, rank_choices, spread_replicas
from hpi_operator.spec import AutoscalingSpec

from .fleet import Member
from .oracle import Foresight
from .pools import SimPool

POLL_S = float(AutoscalingSpec().poll_interval_s)  # the operator's default, as the engine polls


def pod_load(member: Member) -> PodLoad:
    """What the operator's scrape of one ready pod reads (vLLM's gauges and counters)."""
    r = member.replica
    return PodLoad(pod=r.name, kv_utilization=r.kv_usage, num_waiting=len(r.waiting), num_running=len(r.running),
                   num_finished=r.num_finished, prompt_tokens=r.prompt_tokens_total,
                   generation_tokens=r.generation_tokens_total)  # fmt: skip


class Control(Protocol):
    name: str

    def poll(self, ready: Sequence[Member], current: Mapping[str, int], now_s: float) -> dict[str, int]: ...

    def slo_batches(self) -> Mapping[str, int]:
        """Per pool, the SLO batch its plan gives the router (the operator's pool profile ConfigMaps); empty
        without a plan."""
        ...


class OptimizerControl:
    def __init__(self, pools: Sequence[SimPool], slo: Slo, settings: AutoscalingSpec,
                 utilization: float = DEFAULT_UTILIZATION, name: str = "optimizer", lead_s: float | None = None,
                 poll_s: float = POLL_S, foresight: Foresight | None = None):  # fmt: skip
        """`settings`: the spec's autoscaling section (its windows and step; the scale-down window in effect comes
        from its `scale_down_window_s` and the lead, as fleet_loop.py takes it)."""
        self.name, self.pools, self.slo, self.settings, self.utilization = name, list(pools), slo, settings, utilization
        self.foresight = foresight  # an oracle run: the future's peak rate instead of the forecast (oracle.py)
        self.lead_s, self.poll_s = lead_s, poll_s  # spec.autoscaling.leadTimeSeconds (None: from the start times)
        self.start_s: dict[str, float] = {}
        self.last_lead: Lead | None = None
        self.trend: Trend | None = None
        self.counters: Mapping[str, Counters] = {}
        self.at_s: float | None = None
        self.mix: tuple[float, float] | None = None
        self.histories: dict[str, Recommendations] = {}
        self.last_plan = None
        self.batches: dict[str, int] = {}  # the last plan's SLO batches (slo_batches)

    def slo_batches(self) -> Mapping[str, int]:
        return self.batches

    def poll(self, ready: Sequence[Member], current: Mapping[str, int], now_s: float) -> dict[str, int]:
        for member in ready:
            member.replica.advance(now_s)
        reading = read_demand([pod_load(m) for m in ready], self.counters, self.at_s, now_s, self.mix)
        demand = reading.demand
        if reading.measured:  # fleet_loop.py's order: the trend, then the rate to plan for
            self.trend = update(self.trend, demand.request_rate, now_s)
        context = demand.mean_prompt_tokens + demand.mean_output_tokens / 2
        offers = [PoolOffer(p.name, p.performance_at(context), p.cost_per_hour, p.max_replicas, 0) for p in self.pools]
        starts: dict[str, list[float]] = {}
        for member in ready:
            starts.setdefault(member.pool, []).append(member.ready_at_s - member.created_s)
        self.start_s = start_times(starts, self.start_s)
        self.last_lead = lead_time(self.lead_s, self.start_s, pools_meeting_slo(offers, demand, self.slo), self.poll_s)
        if self.foresight is not None:
            f = self.foresight
            demand = Demand(f.peak_rate(now_s, self.last_lead.seconds), f.mean_prompt_tokens, f.mean_output_tokens)
        elif self.trend is not None:
            demand = replace(demand, request_rate=planned_rate(self.trend, demand.request_rate, self.last_lead.seconds))
        plan = optimize(demand, self.slo, offers, self.utilization)
        self.last_plan = plan
        self.batches = {pool: capacity.slo_max_num_seqs for pool, capacity in plan.capacities.items()}
        recommended = {p.name: plan.replicas.get(p.name, 0) for p in self.pools}
        if not reading.measured:  # the first poll only starts the counters (fleet_loop.py does the same)
            recommended = dict(current)
        bounds = {p.name: (0, p.max_replicas) for p in self.pools}
        settings = self.settings
        lead_s = self.last_lead.seconds
        down_s = settings.scale_down_window_s(lead_s, falling(self.trend, reading.demand.request_rate, lead_s))
        window = Window(settings.scale_up_stabilization_s, down_s, settings.max_scale_step)
        replicas, self.histories = stabilize_all(current, recommended, self.histories, bounds, now_s, window)
        self.counters, self.at_s = reading.counters, now_s
        self.mix = (reading.demand.mean_prompt_tokens, reading.demand.mean_output_tokens)
        return replicas


class KvControl:
    def __init__(self, pools: Sequence[SimPool], settings: AutoscalingSpec, name: str = "kv-baseline"):
        self.name, self.settings = name, settings
        ranked = rank_choices([p.choice for p in pools], [])
        self.slots = [Slot(c.pool.name, c.capacity) for c in ranked]
        self.history = History()
        self.last_decision = None

    def poll(self, ready: Sequence[Member], current: Mapping[str, int], now_s: float) -> dict[str, int]:
        for member in ready:
            member.replica.advance(now_s)
        observation = Observation(loads=tuple(pod_load(m) for m in ready))
        decision = decide(self.settings, sum(current.values()), observation, self.history, now_s)
        self.history, self.last_decision = decision.history, decision
        return spread_replicas(decision.desired_replicas, self.slots)

    def slo_batches(self) -> Mapping[str, int]:
        return {}  # today's autoscaling plans no SLO: the router shares by speed


class FixedControl:
    def __init__(self, replicas: Mapping[str, int], name: str = "fixed", slo_batches: Mapping[str, int] | None = None):
        """`slo_batches`: the plan's, for the router (the floor's fixed fleets are optimizer plans)."""
        self.name, self.replicas, self.batches = name, dict(replicas), dict(slo_batches or {})

    def poll(self, ready: Sequence[Member], current: Mapping[str, int], now_s: float) -> dict[str, int]:
        return dict(self.replicas)

    def slo_batches(self) -> Mapping[str, int]:
        return self.batches
