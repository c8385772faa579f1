"""Whole simulated runs: seeded runs replay exactly, and the router adapter really runs hpi_router's policy."""

from __future__ import annotations

import pytest
from fleet_sim.engine import RunConfig, Simulation
from fleet_sim.metrics import RequestResult, summarize
from fleet_sim.pools import headline_pools
from fleet_sim.replay import backend, replay
from fleet_sim.routing import SimRouter
from fleet_sim.scaling import FixedControl
from fleet_sim.workloads import AZURE_CONV_2023, Arrivals, Request, generate

from hpi_operator.fleet.performance import Slo

SLO = Slo(2.0, 0.1)
FLEET = {"h200-bf16": 1, "l4-int8": 4, "cpu-bf16": 1}


def _run(seed: int, strategy: str = "load") -> list[tuple]:
    requests = generate(Arrivals("mmpp", 8.0, 60.0), AZURE_CONV_2023, seed)
    config = RunConfig(pools=headline_pools(1260.0), requests=requests, control=FixedControl(FLEET),
                       initial_replicas=FLEET, duration_s=60.0, strategy=strategy, slo=SLO)  # fmt: skip
    run = Simulation(config).run()
    return [(r.request_id, r.pool, r.ttft_s, r.e2e_s) for r in run.results]


def test_a_seeded_run_replays_exactly():
    first = _run(seed=3)
    assert first and first == _run(seed=3)
    assert first != _run(seed=4)


def test_the_cost_is_kept_by_replica_state_and_a_replica_costs_while_it_starts():
    requests = generate(Arrivals("poisson", 4.0, 120.0), AZURE_CONV_2023, 1)
    grow = {**FLEET, "l4-int8": 6}  # two more L4s asked for at the first poll: 120 s of start each
    config = RunConfig(pools=headline_pools(1260.0), requests=requests, control=FixedControl(grow),
                       initial_replicas=FLEET, duration_s=120.0, slo=SLO)  # fmt: skip
    run = Simulation(config).run()
    assert sum(run.cost_by_state.values()) == pytest.approx(run.cost_usd)
    assert run.cost_by_state["starting"] == pytest.approx(2 * (120.0 - 15.0) / 3600 * 0.8048)  # asked for at 15 s
    assert run.cost_by_state["ready"] > 0


def test_round_robin_takes_turns():
    router = SimRouter("round-robin")
    router.set_backends(["a", "b", "c"])
    picks = [router.pick()[0] for _ in range(30)]
    assert {name: picks.count(name) for name in "abc"} == {"a": 10, "b": 10, "c": 10}


def test_the_capacity_aware_policy_favours_the_faster_backend():
    router = SimRouter("load")
    router.set_backends(["fast", "slow"])
    for now, tokens in ((1.0, 0), (2.0, 1)):  # scrapes: fast makes 400 tokens/s for 2 requests, slow 40
        router.observe("fast", 2, 0, 0.1, 400 * tokens, now)
        router.observe("slow", 2, 0, 0.1, 40 * tokens, now)
    picks = [router.pick()[0] for _ in range(44)]
    assert picks.count("fast") >= 4 * picks.count("slow")


def test_the_router_in_the_loop_beats_round_robin_on_a_mixed_fleet():
    def p90_ttft(rows: list[tuple]) -> float:
        ttfts = sorted(row[2] for row in rows)
        return ttfts[int(0.9 * len(ttfts))]

    aware, blind = _run(seed=5, strategy="load"), _run(seed=5, strategy="round-robin")
    assert sum(1 for row in aware if row[1] == "cpu-bf16") < sum(1 for row in blind if row[1] == "cpu-bf16")
    assert p90_ttft(aware) < p90_ttft(blind)


def test_replay_spreads_a_request_list_over_two_backends():
    requests = [Request(0.1 * i, 200, 30) for i in range(40)]
    summary = replay(requests, [backend(0.02, 0.002, 800, 20_000)] * 2, strategy="round-robin")
    assert summary["num_requests"] == 40 and summary["num_errors"] == 0
    assert {r["backend"] for r in summary["per_request"]} == {"backend-0", "backend-1"}
    assert summary["output_tokens_per_s"] > 0 and summary["ttft_ms"]["p50"] > 0


def test_misses_are_counted_by_pool_and_target():
    """The summary says which target each pool's misses broke (TTFT, mean ITL or both) and how long the prompts
    that came late were, against the pool's own."""
    slo = Slo(ttft_p90_s=1.0, itl_p90_s=0.1)
    results = [
        RequestResult(0, 0.0, 100, 11, 0.5, 1.5, "a", 0),  # within: ITL (1.5 - 0.5) / 10 = 0.1
        RequestResult(1, 0.0, 4000, 11, 1.5, 2.5, "a", 0),  # late
        RequestResult(2, 0.0, 300, 11, 0.5, 3.5, "b", 0),  # slow: ITL 0.3
        RequestResult(3, 0.0, 5000, 11, 2.0, 5.0, "b", 0),  # both
    ]
    summary = summarize(results, 0, slo, 1.0, 10.0)
    assert summary["slo_attainment"] == 0.25
    assert summary["misses_by_pool"] == {
        "a": {"ttft": 1, "itl": 0, "both": 0, "prompt_p50": 2050.0, "late_prompt_p50": 4000.0, "output_p50": 11.0,
              "slow_output_p50": None},
        "b": {"ttft": 0, "itl": 1, "both": 1, "prompt_p50": 2650.0, "late_prompt_p50": 5000.0, "output_p50": 11.0,
              "slow_output_p50": 11.0},
    }
