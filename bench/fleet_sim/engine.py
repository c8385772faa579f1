"""The event loop: one heap of timed events over the fleet, the router and a controller.

Events: a request arrives (the router picks a replica, the replica takes it), a replica's next batch change is
due (finished requests go back through the router), the router scrapes every ready replica (its monitor's
interval), the controller polls (the operator's poll interval), a started replica turns ready (after its pool's
cold start), and a timeline sample for the report. Replica events carry the replica's plan version: a re-plan
makes older ones stale, and they are dropped when popped. Ties break by push order, so a seeded run replays
exactly. After the last arrival the periodic events stop and the replicas run until every request is done; cost
counts up to the end of the workload.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from hpi_contracts.pool_profile import PoolProfile
from hpi_operator.fleet.performance import Slo

from .fleet import Fleet, Member
from .metrics import RequestResult, percentiles, within
from .pools import SimPool
from .replica import Replica, Seq
from .routing import SimRouter
from .scaling import Control
from .workloads import Request

ARRIVAL, REPLICA, SCRAPE, POLL, READY, SAMPLE = range(6)


@dataclass(frozen=True)
class RunConfig:
    pools: Sequence[SimPool]
    requests: Sequence[Request]
    control: Control
    initial_replicas: Mapping[str, int]
    duration_s: float
    strategy: str = "load"  # the router's policy.strategy
    slo: Slo | None = None
    poll_interval_s: float = 15.0  # the operator's autoscaling.pollIntervalSeconds default
    scrape_interval_s: float | None = None  # None: the router's own default
    sample_interval_s: float = 60.0


@dataclass
class RunResult:
    results: list[RequestResult]
    num_unserved: int
    cost_usd: float
    timeline: list[dict] = field(default_factory=list)
    num_events: int = 0
    wall_s: float = 0.0
    peak_replicas: int = 0
    cpu_s: float = 0.0  # this process's CPU time: the wall time on a machine shared with other work overstates
    cost_by_state: dict[str, float] = field(default_factory=dict)  # dollars while starting / ready / draining


class Simulation:
    def __init__(self, config: RunConfig):
        self.config = config
        self.fleet = Fleet(config.pools)
        self.router = SimRouter(config.strategy, config.scrape_interval_s)
        # What each pool's pods export as hpi:profile_* (the operator mounts the pool's figures): the router's prior.
        self._profiles = {p.name: p.engine.performance.as_profile() for p in config.pools}
        self._heap: list[tuple[float, int, int, object, int]] = []
        self._pushes = 0
        self._handles: dict[int, object] = {}
        self.results: list[RequestResult] = []
        self.num_unserved = 0
        self.timeline: list[dict] = []
        self._window: list[RequestResult] = []
        self._arrived_in_window = 0
        self.peak_replicas = 0

    def _push(self, at_s: float, kind: int, obj: object = None, version: int = 0) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (at_s, self._pushes, kind, obj, version))

    def _schedule(self, replica: Replica) -> None:
        if replica.event_s is not None:
            self._push(replica.event_s, REPLICA, replica, replica.version)

    def _ready_changed(self) -> None:
        self.router.set_backends(m.replica.name for m in self.fleet.ready())

    def _scale(self, target: Mapping[str, int], now_s: float) -> None:
        started, draining = self.fleet.scale_to(target, now_s)
        for member in started:
            self._push(member.ready_at_s, READY, member.replica.name)
        self.fleet.retire_idle_drainers(now_s)
        if draining:
            self._ready_changed()
        self.peak_replicas = max(self.peak_replicas, sum(self.fleet.counts().values()))

    def run(self) -> RunResult:
        config, start, cpu_start = self.config, time.perf_counter(), time.process_time()
        self._scale(config.initial_replicas, 0.0)
        for member in list(self.fleet.members.values()):  # the day starts warm
            self.fleet.mark_ready(member.replica.name, 0.0)
        self._ready_changed()
        requests = config.requests
        if requests:
            self._push(requests[0].arrival_s, ARRIVAL, 0)
        self._push(self.router.scrape_interval_s, SCRAPE)
        self._push(config.poll_interval_s, POLL)
        self._push(config.sample_interval_s, SAMPLE)
        num_events = 0
        while self._heap:
            now, _, kind, obj, version = heapq.heappop(self._heap)
            if kind == REPLICA:
                replica = obj
                if version != replica.version:
                    continue
                self._finish(replica.on_event(now), now)
                self._schedule(replica)
            elif kind == ARRIVAL:
                self._arrive(obj, now)
            elif now <= config.duration_s:
                if kind == SCRAPE:
                    self._scrape(now)
                    self._push(now + self.router.scrape_interval_s, SCRAPE)
                elif kind == POLL:
                    ready = self.fleet.ready()
                    self._scale(config.control.poll(ready, self.fleet.counts(), now), now)
                    self._push(now + config.poll_interval_s, POLL)
                elif kind == READY:
                    if self.fleet.mark_ready(obj, now):
                        self._ready_changed()
                elif kind == SAMPLE:
                    self._sample(now)
                    self._push(now + config.sample_interval_s, SAMPLE)
            num_events += 1
        cost = self.fleet.cost_until(config.duration_s)
        return RunResult(self.results, self.num_unserved, cost, self.timeline, num_events,
                         time.perf_counter() - start, self.peak_replicas, time.process_time() - cpu_start,
                         dict(self.fleet.cost_by_state))  # fmt: skip

    def _arrive(self, index: int, now: float) -> None:
        request = self.config.requests[index]
        if index + 1 < len(self.config.requests):
            self._push(self.config.requests[index + 1].arrival_s, ARRIVAL, index + 1)
        self._arrived_in_window += 1
        choice = self.router.pick()
        if choice is None:
            self.num_unserved += 1
            return
        name, handle = choice
        self._handles[index] = handle
        replica = self.fleet.members[name].replica
        replica.submit(Seq(index, request.arrival_s, request.prompt_tokens, request.output_tokens), now)
        self._schedule(replica)

    def _finish(self, finished: list[Seq], now: float) -> None:
        for seq in finished:
            self.router.finish(self._handles.pop(seq.request_id))
            result = RequestResult(seq.request_id, seq.arrival_s, seq.prompt_tokens, seq.output_tokens,
                                   seq.first_token_s - seq.arrival_s, now - seq.arrival_s,
                                   self.fleet.members[seq.replica].pool, seq.num_preemptions)  # fmt: skip
            self.results.append(result)
            self._window.append(result)
        if finished:
            member = self.fleet.members[finished[0].replica]
            if member.state == "draining" and not member.replica.busy:
                self.fleet.retire_idle_drainers(now)

    def _scrape(self, now: float) -> None:
        batches = self.config.control.slo_batches()
        for member in self.fleet.ready():
            r = member.replica
            r.advance(now)
            self.router.observe(r.name, len(r.running), len(r.waiting), r.kv_usage, r.generation_tokens_total, now,
                                self._profile(member.pool, batches.get(member.pool)))
        self.router.end_scrape_round()

    def _profile(self, pool: str, planned: int | None) -> PoolProfile | None:
        """The pool's profile as its pods export it: with the SLO batch the control `planned`, as the operator
        writes it into the pool's profile ConfigMap (hpi_operator.plan), when it plans one."""
        profile = self._profiles.get(pool)
        if profile is None or planned == profile.slo_max_num_seqs:
            return profile
        self._profiles[pool] = replace(profile, slo_max_num_seqs=planned)
        return self._profiles[pool]

    def _sample(self, now: float) -> None:
        window, slo = self._window, self.config.slo
        members: list[Member] = list(self.fleet.members.values())
        point = {
            "t_s": round(now, 3),
            "replicas": {p.name: sum(1 for m in members if m.pool == p.name) for p in self.config.pools},
            "cost_usd": round(self.fleet.cost_until(now), 4),
            "arrival_rps": self._arrived_in_window / self.config.sample_interval_s,
            "ttft_p90_ms": _ms(percentiles([r.ttft_s for r in window], (90,))["p90"]),
            "itl_p90_ms": _ms(percentiles([r.mean_itl_s for r in window if r.output_tokens > 1], (90,))["p90"]),
        }
        if slo is not None and window:
            point["slo_attainment"] = round(sum(1 for r in window if within(r, slo)) / len(window), 4)
        self.timeline.append(point)
        self._window, self._arrived_in_window = [], 0


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 2)
