"""The fleet optimizer in the operator: demand from the pods' counters, per-pool stabilization, the poll that
turns a Plan and pod loads into replicas per pool with an explanation, the plan running them, and the real kopf
operator doing it all against the API emulator (pods played by loopback /metrics servers whose counters grow
at a request rate the test sets)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest

from hpi_operator.autoscaling.decision import PodLoad
from hpi_operator.autoscaling.fleet_loop import fleet_poll
from hpi_operator.fleet.demand import read_demand
from hpi_operator.fleet.forecast import Trend, falling
from hpi_operator.fleet.optimizer import DEFAULT_UTILIZATION, PoolOffer, optimize
from hpi_operator.fleet.performance import Demand, PoolPerformance, Slo, replica_capacity
from hpi_operator.fleet.stabilize import Window, stabilize_all
from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.manifests import common_labels
from hpi_operator.names import LABEL_POOL
from hpi_operator.nodes import node_info
from hpi_operator.op_metrics import OperatorMetrics
from hpi_operator.plan import make_plan
from hpi_operator.spec import SpecError, parse_spec
from hpi_testing.kube_emulator import H200, L4, eventually, make_node, operator_thread, runtime_pod
from hpi_testing.server import serve_metrics

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
SLO = {"ttftP90": "1s", "itlP90": "100ms"}
# Figures as `hpi profile` prints them (spec.placement.pools[].performance), so the expected plan is exact.
FAST = {"itlAlphaMs": 10, "itlBetaMs": 0.2, "prefillTokensPerSecond": 20000, "maxNumSeqs": 200}
SMALL = {"itlAlphaMs": 30, "itlBetaMs": 1.0, "prefillTokensPerSecond": 4000, "maxNumSeqs": 40}
NODES = [node_info(make_node("h200-0", gpu=H200)), *(node_info(make_node(f"l4-{i}", gpu=L4)) for i in range(6))]


def perf(raw: dict[str, float]) -> PoolPerformance:
    return PoolPerformance(raw["itlAlphaMs"] / 1e3, raw["itlBetaMs"] / 1e3, raw["prefillTokensPerSecond"],
                           int(raw["maxNumSeqs"]), source="override")  # fmt: skip


# The tests' headroom, set in the spec rather than left to the default: at 12 req/s it plans for 15, one H200 and
# one L4 clear of any boundary (at 0.9, 12 req/s would need exactly one H200's 13.3: a rate measured 0.1% high
# would add an L4), and a change of the default does not move what the tests expect.
UTILIZATION = 0.8


def optimized_cr(name: str = "fleet", **autoscaling: Any) -> dict[str, Any]:
    settings = {"enabled": True, "mode": "optimizer", "pollIntervalSeconds": 1, "scaleDownStabilizationSeconds": 0,
                "maxScaleStep": 10, "targetCapacityUtilization": UTILIZATION, **autoscaling}  # fmt: skip
    pools = [{"name": "gpu-h200", "costPerHour": 10.0, "performance": FAST},
             {"name": "gpu-l4", "costPerHour": 0.8, "performance": SMALL}]  # fmt: skip
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS, "uid": "u-1"},
            "spec": {"replicas": 1, "slo": SLO, "autoscaling": settings, "placement": {"pools": pools}}}  # fmt: skip


def pool_names(body: dict[str, Any]) -> list[str]:
    return sorted(make_plan(body, NODES).replicas_by_pool)


def load(pod: str, finished: float, prompt: float, generated: float) -> PodLoad:
    return PodLoad(pod, 0.3, 0, 1, num_finished=finished, prompt_tokens=prompt, generation_tokens=generated)


def test_demand_is_the_growth_of_the_pods_counters_between_polls() -> None:
    first = read_demand([load("a", 100, 50_000, 20_000)], {}, None, 1000.0)
    assert not first.measured and first.demand.request_rate == 0
    second = read_demand([load("a", 130, 65_000, 26_000), load("b", 5, 100, 100)], first.counters, 1000.0, 1010.0)
    assert second.measured and second.demand.request_rate == pytest.approx(3.0)  # b is new: from its next poll
    assert (second.demand.mean_prompt_tokens, second.demand.mean_output_tokens) == (500, 200)
    restarted = read_demand([load("a", 2, 1000, 400)], second.counters, 1010.0, 1020.0, (500, 200))
    assert restarted.demand.request_rate == 0 and restarted.demand.mean_prompt_tokens == 500


def test_demand_counts_arrivals_still_in_the_pod_and_an_older_memory_counts_completions() -> None:
    def at(finished: float, running: float, waiting: float) -> PodLoad:
        return PodLoad("a", 0.5, waiting, running, num_finished=finished, prompt_tokens=finished * 500,
                       generation_tokens=finished * 200)  # fmt: skip

    first = read_demand([at(100, 4, 0)], {}, None, 1000.0)
    # 30 finished in 10 s while the pod went from 4 to 20 requests in it: 46 arrived.
    rising = read_demand([at(130, 16, 4)], first.counters, 1000.0, 1010.0)
    assert rising.demand.request_rate == pytest.approx(4.6)
    draining = read_demand([at(160, 6, 0)], rising.counters, 1010.0, 1020.0)
    assert draining.demand.request_rate == pytest.approx(1.6)  # 30 finished, 14 fewer in the pod
    older = {"a": (100.0, 50_000.0, 20_000.0)}  # a status written before the in-pod count was kept
    assert read_demand([at(130, 16, 4)], older, 1000.0, 1010.0).demand.request_rate == pytest.approx(3.0)


def test_stabilization_holds_dips_and_spikes_for_their_windows_and_limits_the_step() -> None:
    window = Window(scale_up_s=10, scale_down_s=60, max_step=2)
    replicas, memory = stabilize_all({"p": 5}, {"p": 1}, {"p": [(0.0, 5)]}, {"p": (0, 9)}, 30.0, window)
    assert replicas == {"p": 5}  # a recommendation of 5 half a minute ago: the dip has not lasted the window
    replicas, _ = stabilize_all({"p": 5}, {"p": 1}, memory, {"p": (0, 9)}, 100.0, window)
    assert replicas == {"p": 3}  # the window passed: down, two at a time
    replicas, _ = stabilize_all({"p": 1}, {"p": 9}, {}, {"p": (0, 4)}, 0.0, window)
    assert replicas == {"p": 3}  # up two at a time
    replicas, _ = stabilize_all({"p": 3}, {"p": 9}, {}, {"p": (0, 4)}, 0.0, window)
    assert replicas == {"p": 4}  # never above the pool's bound


def test_optimizer_mode_needs_an_slo() -> None:
    body = optimized_cr()
    del body["spec"]["slo"]
    with pytest.raises(SpecError, match="spec.slo"):
        parse_spec(body["spec"])


def test_the_plan_runs_the_optimizers_replicas_per_pool() -> None:
    body = optimized_cr()
    h200, l4 = pool_names(body)
    assert sum(make_plan(body, NODES).replicas_by_pool.values()) == 1  # before a decision: spec.replicas
    body["status"] = {"autoscaling": {"optimizer": {"replicas": {l4: 3, h200: 0}}}}
    plan = make_plan(body, NODES)
    assert dict(plan.replicas_by_pool) == {h200: 0, l4: 3} and plan.desired_replicas == 3
    assert {d["metadata"]["name"]: d["spec"]["replicas"] for d in plan.deployments} == {
        f"fleet-{h200}": 0, f"fleet-{l4}": 3}


def test_a_poll_chooses_the_cheapest_pools_within_the_slo_and_explains_it() -> None:
    body = optimized_cr()
    h200, l4 = pool_names(body)
    plan = make_plan(body, NODES)
    current = dict(plan.replicas_by_pool)
    first = fleet_poll(plan, [load("p0", 0, 0, 0)], {}, current, 1000.0)
    assert first.replicas == current and not first.changed  # counters start; nothing measured yet
    status = {"autoscaling": {"optimizer": first.status}}
    # 12 req/s of 500-token prompts and 200-token answers over the next 10 s.
    second = fleet_poll(plan, [load("p0", 120, 60_000, 24_000)], status, current, 1010.0)
    demand = Demand(12.0, 500, 200)
    offers = [PoolOffer(h200, perf(FAST), 10.0, 1), PoolOffer(l4, perf(SMALL), 0.8, 6)]
    expected = optimize(demand, Slo(1.0, 0.1), offers, UTILIZATION)
    assert second.replicas == dict(expected.replicas) and second.changed and second.feasible
    assert second.message.startswith(", ".join(f"{p} {current[p]} -> {n}" for p, n in second.replicas.items()
                                               if current[p] != n))  # fmt: skip
    assert "demand 12.00 req/s (500 prompt, 200 output tokens)" in second.message
    assert second.status["pools"][l4]["source"] == "override"
    assert second.status["slo"] == {"attainment": None, "ttftP90": None, "itlP90": None, "requests": 0,
                                    "window": 10.0}  # these loads carry no histograms  # fmt: skip


def test_each_pools_slo_batch_is_planned_and_handed_to_its_pods_for_the_router() -> None:
    """The router shares load by the batch the optimizer plans each pool at within the SLO (router policy.py): the
    poll keeps it per pool in status, and the plan writes it into the pool's profile ConfigMap beside the figures
    (a pool that cannot meet the SLO at any load: 1)."""
    body = optimized_cr()
    h200, l4 = pool_names(body)
    plan = make_plan(body, NODES)
    assert all("sloMaxNumSeqs" not in json.loads(c["data"]["profile.json"]) for c in plan.profile_configmaps)
    current = dict(plan.replicas_by_pool)
    first = fleet_poll(plan, [load("p0", 0, 0, 0)], {}, current, 1000.0)
    second = fleet_poll(plan, [load("p0", 120, 60_000, 24_000)], {"autoscaling": {"optimizer": first.status}},
                        current, 1010.0)  # fmt: skip
    demand, slo = Demand(12.0, 500, 200), Slo(1.0, 0.1)
    batches = {pool: replica_capacity(perf(figures), demand, slo).batch
               for pool, figures in ((h200, FAST), (l4, SMALL))}  # fmt: skip
    assert batches[h200] > batches[l4] > 1
    assert {p: second.status["pools"][p]["sloMaxNumSeqs"] for p in (h200, l4)} == batches
    body["status"] = {"autoscaling": {"optimizer": second.status}}
    served = {c["metadata"]["name"]: json.loads(c["data"]["profile.json"]) for c in make_plan(body, NODES)
              .profile_configmaps}  # fmt: skip
    assert {p: served[f"fleet-{p}-profile"]["sloMaxNumSeqs"] for p in (h200, l4)} == batches
    assert served[f"fleet-{l4}-profile"]["itlAlphaMs"] == SMALL["itlAlphaMs"]  # the figures themselves unchanged
    hopeless = replica_capacity(perf({**SMALL, "itlAlphaMs": 150}), demand, slo)
    assert not hopeless.meets_slo and hopeless.slo_max_num_seqs == 1
    builtin = {**body, "spec": {**body["spec"], "autoscaling": {"enabled": True, "mode": "builtin"}}}
    assert all("sloMaxNumSeqs" not in json.loads(c["data"]["profile.json"] or "{}")
               for c in make_plan(builtin, NODES).profile_configmaps)  # no plan of the optimizer's: none


def test_target_capacity_utilization_sets_the_plans_headroom() -> None:
    """spec.autoscaling.targetCapacityUtilization is the share of each replica's SLO capacity the plan fills: its
    default is the optimizer's, a lower one plans more replicas for the same demand, and one outside (0, 1] is a
    spec error."""
    unset = optimized_cr()
    del unset["spec"]["autoscaling"]["targetCapacityUtilization"]
    assert parse_spec(unset["spec"]).autoscaling.target_capacity_utilization == DEFAULT_UTILIZATION
    demand = Demand(12.0, 500, 200)
    for utilization in (0.5, 1.0):
        body = optimized_cr(targetCapacityUtilization=utilization)
        h200, l4 = pool_names(body)
        plan = make_plan(body, NODES)
        current = dict(plan.replicas_by_pool)
        first = fleet_poll(plan, [load("p0", 0, 0, 0)], {}, current, 1000.0)
        status = {"autoscaling": {"optimizer": first.status}}
        second = fleet_poll(plan, [load("p0", 120, 60_000, 24_000)], status, current, 1010.0)
        offers = [PoolOffer(h200, perf(FAST), 10.0, 1), PoolOffer(l4, perf(SMALL), 0.8, 6)]
        assert second.replicas == dict(optimize(demand, Slo(1.0, 0.1), offers, utilization).replicas)
        if utilization == 0.5:
            headroom = sum(second.replicas.values())
    assert headroom > sum(second.replicas.values())  # half the capacity planned: more replicas than at full use
    for bad in (0.0, 1.5):
        with pytest.raises(SpecError, match="targetCapacityUtilization"):
            parse_spec(optimized_cr(targetCapacityUtilization=bad)["spec"])


def test_a_rising_demand_is_planned_one_lead_time_ahead_and_the_trend_is_kept_in_status() -> None:
    body = optimized_cr(leadTimeSeconds=60)
    plan = make_plan(body, NODES)
    current = dict(plan.replicas_by_pool)
    status: dict = {}
    finished, rates = 0.0, (2.0, 4.0, 6.0, 8.0)  # +2 req/s every 10 s
    poll = fleet_poll(plan, [load("p0", 0, 0, 0)], status, current, 1000.0)
    for i, rate in enumerate(rates, start=1):
        status = {"autoscaling": {"optimizer": poll.status}}
        finished += rate * 10
        loads = [load("p0", finished, finished * 500, finished * 200)]
        poll = fleet_poll(plan, loads, status, current, 1000.0 + 10 * i)
    trend = poll.status["trend"]
    level, slope = trend[0], trend[1]
    assert slope > 0 and poll.status["demand"]["requestRate"] == pytest.approx(8.0)
    planned = poll.status["demand"]["plannedRequestRate"]
    assert planned == pytest.approx(level + slope * 60, rel=1e-3) and planned > 8.0
    assert f"rising: planned for {planned:.2f} req/s in 60 s" in poll.message
    flat = fleet_poll(plan, [load("p0", finished, finished * 500, finished * 200)],
                      {"autoscaling": {"optimizer": {**poll.status, "trend": None}}}, current, 1050.0)  # fmt: skip
    assert flat.status["demand"]["plannedRequestRate"] == flat.status["demand"]["requestRate"]  # no trend yet


def test_unset_the_lead_is_the_pools_measured_start_plus_two_polls_and_is_remembered() -> None:
    body = optimized_cr(pollIntervalSeconds=15)
    h200, l4 = pool_names(body)
    plan = make_plan(body, NODES)
    current = dict(plan.replicas_by_pool)
    poll = fleet_poll(plan, [load("p0", 0, 0, 0)], {}, current, 1000.0, starts={l4: [150.0, 160.0]})
    # Both pools meet this SLO; the H200 has no pod seen starting yet: assumed 120 s, so the L4's 160 s sets it.
    assert poll.status["leadTime"] == {"seconds": 190.0, "source": "measured", "pool": l4}
    assert poll.status["startSeconds"] == {l4: 160.0}
    finished = 0.0
    for i, rate in enumerate((2.0, 4.0, 6.0), start=1):  # rising, and no ready L4 pod this time: remembered
        finished += rate * 15
        status = {"autoscaling": {"optimizer": poll.status}}
        poll = fleet_poll(plan, [load("p0", finished, finished * 500, finished * 200)], status, current,
                          1000.0 + 15 * i, starts={h200: [95.0]})  # fmt: skip
    assert poll.status["startSeconds"] == {h200: 95.0, l4: 160.0}
    assert poll.status["leadTime"]["seconds"] == 190.0
    planned = poll.status["demand"]["plannedRequestRate"]
    assert f"rising: planned for {planned:.2f} req/s in 190 s ({l4} starts in 160 s (measured) + 2 polls)" in (
        poll.message)  # fmt: skip
    set_by_spec = fleet_poll(make_plan(optimized_cr(leadTimeSeconds=30), NODES), [load("p0", 0, 0, 0)], {},
                             current, 1000.0, starts={l4: [150.0]})  # fmt: skip
    assert set_by_spec.status["leadTime"] == {"seconds": 30.0, "source": "spec", "pool": None}


@pytest.mark.parametrize(("set_s", "window_s"), [(None, 60), (20, 20)])
def test_unset_the_scale_down_window_is_the_lead_time(set_s: int | None, window_s: int) -> None:
    """A replica released sooner than one takes to start is missed when the demand comes back: by default the
    optimizer holds a lower recommendation for its lead time (HPA's 300 s in the KV modes). Here the demand
    falls off a cliff (12 req/s to none), which is no falling trend: the lead holds."""
    body = optimized_cr(scaleDownStabilizationSeconds=set_s, leadTimeSeconds=60, maxScaleStep=100)
    h200, _ = pool_names(body)
    plan = make_plan(body, NODES)
    assert plan.spec.autoscaling.scale_down_window_s() == (300 if set_s is None else set_s)  # no lead: HPA's
    poll = fleet_poll(plan, [load("p0", 0, 0, 0)], {}, dict(plan.replicas_by_pool), 1000.0)
    history = []
    for t in range(1010, 1200, 10):  # 12 req/s for ten seconds, then nothing finishes any more
        poll = fleet_poll(plan, [load("p0", 120, 60_000, 24_000)], {"autoscaling": {"optimizer": poll.status}},
                          poll.replicas, float(t))  # fmt: skip
        history.append((t, poll.replicas[h200], poll.status["recommended"][h200]))
    assert poll.status["scaleDownWindowSeconds"] == window_s
    lower_since = min(t for t, _, recommended in history if recommended == 0)
    released_at = min(t for t, replicas, _ in history if replicas == 0)
    assert released_at - lower_since == window_s


def test_while_the_demand_falls_the_scale_down_window_is_two_polls() -> None:
    """On a falling trend the demand is not expected back within a start time: the optimizer releases replicas
    after two polls instead of holding its lead-long window; on a flat demand the window stays the lead."""
    body = optimized_cr(scaleDownStabilizationSeconds=None, leadTimeSeconds=120, pollIntervalSeconds=15,
                        maxScaleStep=100)  # fmt: skip
    plan = make_plan(body, NODES)
    assert plan.spec.autoscaling.scale_down_window_s(120.0, falling=True) == 30
    assert plan.spec.autoscaling.scale_down_window_s(20.0, falling=True) == 20  # never longer than the lead
    windows = []
    poll = fleet_poll(plan, [load("p0", 0, 0, 0)], {}, dict(plan.replicas_by_pool), 1000.0)
    finished = 0.0
    for i, rate in enumerate((20.0, 20.0, 20.0, 20.0, 16.0, 12.0, 8.0, 4.0), start=1):
        finished += rate * 15
        poll = fleet_poll(plan, [load("p0", finished, finished * 500, finished * 200)],
                          {"autoscaling": {"optimizer": poll.status}}, poll.replicas, 1000.0 + 15 * i)  # fmt: skip
        windows.append(poll.status["scaleDownWindowSeconds"])
    assert windows[:4] == [120.0] * 4 and windows[-3:] == [30.0] * 3  # flat: the lead; falling: two polls
    set_by_spec = make_plan(optimized_cr(scaleDownStabilizationSeconds=200), NODES).spec.autoscaling
    assert set_by_spec.scale_down_window_s(120.0, falling=True) == 200  # a window the spec sets holds


def test_falling_needs_the_slope_to_take_a_real_share_of_the_level_off_over_the_lead_and_no_cliff() -> None:
    trend = Trend(level=100.0, slope=-0.1, at_s=0.0)
    assert falling(trend, 95.0, lead_s=60.0)  # 6 of 100 over the lead
    assert not falling(trend, 40.0, lead_s=60.0)  # a cliff: it may come back as suddenly
    assert not falling(Trend(level=100.0, slope=-0.01, at_s=0.0), 99.0, lead_s=60.0)  # 0.6: a flat day's noise
    assert not falling(Trend(level=100.0, slope=0.5, at_s=0.0), 100.0, lead_s=60.0)
    assert not falling(None, 100.0, 60.0)


def test_a_pool_without_price_is_left_out_and_an_unreachable_slo_says_why() -> None:
    body = optimized_cr()
    h200, l4 = pool_names(body)
    body["spec"]["placement"]["pools"] = [{"name": l4, "costPerHour": 0.8, "performance": SMALL}]
    plan = make_plan(body, NODES)
    status = {"autoscaling": {"optimizer": fleet_poll(plan, [load("p", 0, 0, 0)], {}, {}, 0.0).status}}
    poll = fleet_poll(plan, [load("p", 10_000, 5e6, 2e6)], status, dict(plan.replicas_by_pool), 10.0)
    assert not poll.feasible and poll.status["reason"].startswith("capacity:")
    assert poll.replicas[l4] == 6 and poll.replicas[h200] == 0  # every L4 it has; the H200 has no price
    assert "no price" in poll.status["leftOut"][h200] and "SLO not attainable" in poll.message



def test_a_fleet_at_zero_with_requests_queued_in_the_router_wakes_on_the_cheapest_pool_within_the_slo() -> None:
    body = optimized_cr(minReplicas=0, scaleToZero={"enabled": True})
    h200, l4 = pool_names(body)
    body["status"] = {"autoscaling": {"optimizer": {"replicas": {h200: 0, l4: 0}}}}
    plan = make_plan(body, NODES)
    current = dict(plan.replicas_by_pool)
    assert current == {h200: 0, l4: 0}
    idle = fleet_poll(plan, [], body["status"], current, 1000.0)
    assert sum(idle.replicas.values()) == 0 and "queued" not in idle.message  # no pod, no queue: stays at zero
    woken = fleet_poll(plan, [], body["status"], current, 1000.0, num_router_queued=3)
    pools = woken.status["pools"]
    cheapest = min((p for p in pools if pools[p]["meetsSLO"]),
                   key=lambda p: pools[p]["costPerHour"] / pools[p]["requestRatePerReplica"])  # fmt: skip
    assert cheapest == l4  # 0.8/h for a replica of the small GPU against 10/h for the H200
    assert woken.replicas == {h200: 0, l4: 1} and woken.changed
    assert "3 request(s) queued in the router" in woken.message and f"{l4} 0 -> 1" in woken.message
    # Later polls, counters started: still not zero while the router holds requests (no pod has served yet).
    status = {"autoscaling": {"optimizer": woken.status}}
    later = fleet_poll(plan, [], status, woken.replicas, 1010.0, num_router_queued=1)
    assert later.replicas == {h200: 0, l4: 1}
    floor = fleet_poll(make_plan({**body, "spec": {**body["spec"], "autoscaling": {
        **body["spec"]["autoscaling"], "minReplicas": 2}}}, NODES), [], body["status"], current, 1000.0,
        num_router_queued=1)  # fmt: skip
    assert sum(floor.replicas.values()) == 2  # max(minReplicas, 1)

# How the fake pods started, as hpi serve's /metrics says it (hpi_runtime/startup.py).
STARTUP_TEXT = ('# TYPE hpi:startup_phase_seconds gauge\nhpi:startup_phase_seconds{phase="load"} 3.5\n'
                'hpi:startup_phase_seconds{phase="compile"} 41.25\n# TYPE hpi:startup_seconds gauge\n'
                "hpi:startup_seconds 58.0\n")

# The fake pods' latency, as the share of requests at or below each bound: 4% of TTFTs above 1 s and 2% of mean
# ITLs above 100 ms, so the attainment bound is 1 - 0.04 - 0.02 = 0.94 whatever the request count. p90 TTFT: rank
# 0.9 lies in (0.25, 1.0] holding 0.6..0.96: 0.25 + 0.75 x 0.3 / 0.36 = 0.875 s; p90 ITL in (0.05, 0.1] holding
# 0.5..0.98: 0.05 + 0.05 x 0.4 / 0.48 = 0.0917 s.
TTFT_SHARES = ((0.25, 0.6), (1.0, 0.96), ("+Inf", 1.0))
TPOT_SHARES = ((0.05, 0.5), (0.1, 0.98), ("+Inf", 1.0))


def histogram(name: str, shares: tuple[tuple[float | str, float], ...], done: float) -> str:
    lines = [f"# TYPE {name} histogram"] + [f'{name}_bucket{{le="{le}"}} {share * done}' for le, share in shares]
    return "\n".join([*lines, f"{name}_count {done}", f"{name}_sum {done * 0.1}"]) + "\n"


class CountingRuntime:
    """One loopback /metrics endpoint per fake pod whose request counters grow at `rate` per second."""

    def __init__(self) -> None:
        self.rate, self.runners = 0.0, []

    async def start(self) -> int:
        started = time.time()

        def render() -> str:
            done = self.rate * (time.time() - started)
            return ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.3\n"
                    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4\n"
                    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
                    f"# TYPE vllm:request_success counter\nvllm:request_success_total {done}\n"
                    f"# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total {done * 500}\n"
                    f"# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total {done * 200}\n"
                    + histogram("vllm:time_to_first_token_seconds", TTFT_SHARES, done)
                    + histogram("vllm:request_time_per_output_token_seconds", TPOT_SHARES, done)
                    + STARTUP_TEXT)  # fmt: skip

        runner, port = await serve_metrics(render)
        self.runners.append(runner)
        return port


@contextlib.asynccontextmanager
async def counting_runtime() -> AsyncIterator[CountingRuntime]:
    fake = CountingRuntime()
    try:
        yield fake
    finally:
        for runner in fake.runners:
            await runner.cleanup()


async def test_the_operator_runs_the_optimizers_replicas_per_pool(kube: KubeClient, api: Any, emulator: Any) -> None:
    for node in ("h200-0", *(f"l4-{i}" for i in range(6))):
        gpu = H200 if node.startswith("h200") else L4
        await asyncio.to_thread(kube.request, "POST", "/api/v1/nodes", make_node(node, gpu=gpu))
    body = optimized_cr("fleet")
    del body["metadata"]["uid"]
    h200, l4 = pool_names(optimized_cr())
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    registry = build_registry(OperatorConfig(resync_interval_s=0.5, autoscale_tick_s=0.2))
    async with counting_runtime() as runtime:
        runtime.rate = 12.0
        port = await runtime.start()
        pod = runtime_pod("fleet-0", port, {**common_labels("fleet"), LABEL_POOL: l4}, NS)
        ready_at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=150)  # it took 150 s to start
        pod["status"]["conditions"][0]["lastTransitionTime"] = ready_at.strftime("%Y-%m-%dT%H:%M:%SZ")
        await asyncio.to_thread(kube.request, "POST", f"/api/v1/namespaces/{NS}/pods", pod)
        context = operator_thread(registry, memo=memo)
        await asyncio.to_thread(context.__enter__)
        try:
            await asyncio.to_thread(kube.request, "POST", CRS, body)
            offers = [PoolOffer(h200, perf(FAST), 10.0, 1), PoolOffer(l4, perf(SMALL), 0.8, 6)]
            expected = optimize(Demand(12.0, 500, 200), Slo(1.0, 0.1), offers, UTILIZATION).replicas

            def deployments() -> dict[str, int]:
                items = kube.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments")["items"]
                runtime = [d for d in items if "router" not in d["metadata"]["name"]]
                return {d["metadata"]["name"]: d["spec"]["replicas"] for d in runtime}

            await eventually(lambda: deployments() == {f"fleet-{p}": n for p, n in expected.items()}, timeout_s=60)
            # The rate is a counter's growth over the time between two polls, read a scrape later: on a loaded
            # machine one poll's scrape can lag the other's, so wait for a poll whose reading is within 5%.
            await eventually(lambda: abs(kube.get(f"{CRS}/fleet")["status"]["autoscaling"]["optimizer"]["demand"]
                                         ["requestRate"] - 12.0) <= 0.6, timeout_s=30)  # fmt: skip
            status = (await asyncio.to_thread(kube.get, f"{CRS}/fleet"))["status"]
            optimizer = status["autoscaling"]["optimizer"]
            assert optimizer["replicas"] == dict(expected) and optimizer["feasible"] is True
            assert "req/s (500 prompt, 200 output tokens)" in optimizer["message"]
            # No leadTimeSeconds: the lead is the pod's measured start (creation to Ready) + 2 polls of 1 s.
            assert optimizer["startSeconds"][l4] == pytest.approx(150, abs=2)
            assert optimizer["leadTime"]["source"] == "measured" and optimizer["leadTime"]["pool"] == l4
            assert optimizer["leadTime"]["seconds"] == pytest.approx(optimizer["startSeconds"][l4] + 2)
            # How the pool's pods started, from their own /metrics (the slowest pod's figures).
            assert status["autoscaling"]["startup"] == {
                l4: {"pods": 1, "totalSeconds": 58.0, "phases": {"load": 3.5, "compile": 41.25}}}
            await eventually(lambda: (kube.get(f"{CRS}/fleet")["status"]["autoscaling"]["optimizer"].get("slo")
                                      or {}).get("requests", 0) > 0)  # fmt: skip
            status = (await asyncio.to_thread(kube.get, f"{CRS}/fleet"))["status"]
            slo = status["autoscaling"]["optimizer"]["slo"]
            assert slo["attainment"] == pytest.approx(0.94, abs=1e-3) and slo["window"] > 0
            assert slo["ttftP90"] == pytest.approx(0.875, abs=1e-3) and slo["itlP90"] == pytest.approx(0.0917, abs=1e-3)
            assert "observed: SLO attainment >= 94.0%" in status["autoscaling"]["optimizer"]["message"]
            await eventually(lambda: {c["type"]: (c["status"], "observed attainment >= 94.0%" in c["message"])
                                      for c in kube.get(f"{CRS}/fleet")["status"]["conditions"]}
                             .get("SLOAttainable") == ("True", True))  # fmt: skip
            events = (await asyncio.to_thread(kube.request, "GET", f"/api/v1/namespaces/{NS}/events"))["items"]
            assert any(e["reason"] == "FleetScaled" for e in events)
            # The planned SLO batch reaches the pool's pods (and so the router) through its profile ConfigMap.
            batch = replica_capacity(perf(SMALL), Demand(12.0, 500, 200), Slo(1.0, 0.1)).batch
            assert optimizer["pools"][l4]["sloMaxNumSeqs"] == batch
            await eventually(lambda: json.loads(kube.get(f"/api/v1/namespaces/{NS}/configmaps/fleet-{l4}-profile")
                                                ["data"]["profile.json"]).get("sloMaxNumSeqs") == batch)  # fmt: skip
        finally:
            await asyncio.to_thread(context.__exit__, None, None, None)
