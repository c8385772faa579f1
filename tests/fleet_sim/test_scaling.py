"""The controllers run the operator's decisions: the optimizer loop's replicas are optimize()'s plan for a steady
demand, and the baseline fills pools in rank order."""

from __future__ import annotations

from fleet_sim.fleet import Member
from fleet_sim.pools import headline_pools
from fleet_sim.replay import backend
from fleet_sim.replica import Replica
from fleet_sim.scaling import KvControl, OptimizerControl

from hpi_operator.fleet.optimizer import PoolOffer, optimize
from hpi_operator.fleet.performance import Demand, Slo
from hpi_operator.spec import AutoscalingSpec

# The optimizer's autoscaling section with no stabilization at all: every recommendation applies at once.
AT_ONCE = AutoscalingSpec(enabled=True, mode="optimizer", scale_up_stabilization_s=0, scale_down_stabilization_s=0,
                          max_scale_step=1000)

SLO = Slo(2.0, 0.1)
PROMPT, OUTPUT, RATE = 1000, 200, 40.0


def _member(name: str, finished: float, kv: float = 0.5) -> Member:
    replica = Replica(name, backend(0.01, 0.001, 1000, 10_000))
    replica.num_finished = int(finished)
    replica.prompt_tokens_total, replica.generation_tokens_total = int(finished * PROMPT), int(finished * OUTPUT)
    replica.kv_used = int(kv * 10_000)
    return Member(replica, "l4-int8", 0.0, 0.0, "ready")


def test_the_optimizer_loop_plans_what_optimize_plans():
    pools = headline_pools(PROMPT + OUTPUT / 2)
    control = OptimizerControl(pools, SLO, AT_ONCE)
    current = {"h200-bf16": 1, "l4-int8": 1, "cpu-bf16": 0}
    control.poll([_member("a", 0), _member("b", 0)], current, 0.0)  # the first poll starts the counters
    # 15 s later the two pods finished RATE x 15 requests between them: a steady demand of RATE req/s.
    replicas = control.poll([_member("a", RATE * 15 / 2), _member("b", RATE * 15 / 2)], current, 15.0)
    offers = [PoolOffer(p.name, p.performance_at(PROMPT + OUTPUT / 2), p.cost_per_hour, p.max_replicas)
              for p in pools]  # fmt: skip
    plan = optimize(Demand(RATE, PROMPT, OUTPUT), SLO, offers)
    assert replicas == dict(plan.replicas)
    assert replicas["cpu-bf16"] == 0 and replicas["h200-bf16"] >= 1  # the CPU pool misses the SLO
    # What the operator hands the router with the pools' profiles: each pool's SLO batch (1: it misses the SLO).
    batches = {name: capacity.batch for name, capacity in plan.capacities.items()}
    assert control.slo_batches() == {**batches, "cpu-bf16": 1} and batches["h200-bf16"] > batches["l4-int8"] > 1


def test_the_baseline_scales_the_total_and_fills_pools_in_rank_order():
    pools = headline_pools(1200.0, h200_max=2, l4_max=10, cpu_max=5)
    settings = AutoscalingSpec(enabled=True, mode="builtin", min_replicas=1, max_replicas=17,
                               target_kv_utilization=0.5, scale_up_stabilization_s=0, scale_down_stabilization_s=300,
                               max_scale_step=20, poll_interval_s=15, scale_to_zero=False,
                               scale_to_zero_idle_s=300)  # fmt: skip
    control = KvControl(pools, settings)
    ready = [_member(f"p{i}", 0, kv=0.75) for i in range(4)]  # four pods at 75% KV against a 50% target: 6
    replicas = control.poll(ready, {"h200-bf16": 2, "l4-int8": 2, "cpu-bf16": 0}, 0.0)
    assert replicas == {"h200-bf16": 2, "l4-int8": 4, "cpu-bf16": 0}  # GPU pools first, H200 before L4


def test_an_oracle_plans_for_the_coming_peak_not_the_measured_rate():
    """The oracle control (oracle.py) knows the day's arrivals: with a surge due within the lead time, it plans
    for the surge's rate while the measured rate is still the quiet one; the forecasting control does not."""
    from fleet_sim.oracle import Foresight
    from fleet_sim.workloads import Request

    quiet, surge = 5.0, 60.0  # req/s: quiet for the first 100 s, then the surge
    arrivals = [i / quiet for i in range(int(100 * quiet))] + [100 + i / surge for i in range(int(200 * surge))]
    requests = [Request(t, PROMPT, OUTPUT) for t in arrivals]
    foresight = Foresight(requests)
    assert foresight.rate(0, 60) == quiet and foresight.rate(120, 180) == surge
    assert foresight.peak_rate(0.0, 120.0) == surge  # the window starting at 105 s is inside the lead

    pools = headline_pools(PROMPT + OUTPUT / 2)
    current = {"h200-bf16": 1, "l4-int8": 1, "cpu-bf16": 0}
    plans = {}
    for name, sight in (("oracle", foresight), ("forecast", None)):
        control = OptimizerControl(pools, SLO, AT_ONCE, lead_s=120.0, foresight=sight)
        control.poll([_member("a", 0), _member("b", 0)], current, 0.0)
        n = quiet * 15 / 2  # each pod finished its half of 15 s of quiet traffic
        plans[name] = control.poll([_member("a", n), _member("b", n)], current, 15.0)
    offers = [PoolOffer(p.name, p.performance_at(PROMPT + OUTPUT / 2), p.cost_per_hour, p.max_replicas)
              for p in pools]  # fmt: skip
    expected = optimize(Demand(surge, foresight.mean_prompt_tokens, foresight.mean_output_tokens), SLO, offers)
    assert plans["oracle"] == dict(expected.replicas)
    cost = {name: sum(o.cost_per_hour * plan[o.name] for o in offers) for name, plan in plans.items()}
    assert cost["forecast"] < cost["oracle"] / 2  # the forecast still plans for the quiet rate
