"""The replica model against closed forms, and its KV budget: queueing when full, preemption by recompute."""

from __future__ import annotations

import pytest
from fleet_sim.replay import backend, replay
from fleet_sim.replica import Replica, Seq
from fleet_sim.workloads import Request

ALPHA, BETA, PREFILL = 0.010, 0.001, 1000.0


def test_one_request_matches_the_closed_form():
    # Idle replica: the prompt prefills in one step (under the 2048-token budget), which also samples the first
    # token; then each of the other tokens takes one decode step of alpha + beta x 1.
    summary = replay([Request(1.0, 500, 11)], [backend(ALPHA, BETA, PREFILL, kv_tokens=10_000)])
    (only,) = summary["per_request"]
    ttft = ALPHA + 500 / PREFILL
    assert only["ttft_s"] == pytest.approx(ttft)
    assert only["e2e_s"] == pytest.approx(ttft + 10 * (ALPHA + BETA))
    assert only["mean_itl_s"] == pytest.approx(ALPHA + BETA)


def test_a_long_prompt_is_chunked_under_the_step_budget():
    # 5000 tokens at a 2048-token budget: two full chunks, then the 904 left in a third step.
    summary = replay([Request(0.0, 5000, 2)], [backend(ALPHA, BETA, PREFILL, kv_tokens=10_000)])
    (only,) = summary["per_request"]
    assert only["ttft_s"] == pytest.approx(3 * ALPHA + 5000 / PREFILL)


def test_a_second_request_waits_for_the_step_boundary_and_slows_the_first():
    summary = replay([Request(0.0, 100, 50), Request(0.05, 100, 50)], [backend(ALPHA, BETA, PREFILL, 10_000)])
    first, second = summary["per_request"]
    assert first["mean_itl_s"] > ALPHA + BETA  # shared steps (b = 2, plus a prefill chunk)
    assert second["ttft_s"] > ALPHA + 100 / PREFILL  # joined at a boundary of a busy replica


def _drain(replica: Replica) -> list[Seq]:
    done = []
    while replica.event_s is not None:
        done += replica.on_event(replica.event_s)
    return done


def test_a_full_kv_budget_queues_then_preempts_the_newest():
    replica = Replica("r", backend(ALPHA, BETA, PREFILL, kv_tokens=1000, max_num_seqs=8))
    seqs = [Seq(i, 0.0, 400, 300) for i in range(3)]
    for seq in seqs:
        replica.submit(seq, 0.0)
    done = replica.on_event(replica.event_s)  # the next step boundary admits what fits
    assert len(replica.running) == 2 and len(replica.waiting) == 1  # 400 + 400 + 400 > 1000
    done += _drain(replica)
    assert len(done) == 3 and all(s.generated == 300 for s in done)
    assert replica.num_preemptions >= 1  # two sequences growing by a token a step overflow 1000 tokens
    assert seqs[1].num_preemptions >= 1 and seqs[0].num_preemptions == 0  # the newest goes, the oldest stays
    assert replica.kv_used == 0 and not replica.running


def test_counters_add_up():
    replica = Replica("r", backend(ALPHA, BETA, PREFILL, kv_tokens=100_000))
    for i in range(5):
        replica.submit(Seq(i, 0.0, 100 + i, 20 + i), 0.0)
    _drain(replica)
    assert replica.num_finished == 5
    assert replica.prompt_tokens_total == sum(100 + i for i in range(5))
    assert replica.generation_tokens_total == sum(20 + i for i in range(5))
