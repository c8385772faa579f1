"""bench/lora_schedule.py replays the served LoRA benchmark's closed loop on the real engine: every request
completes, and waiting before draining packs the load into fewer, fuller steps than draining at once (the
reason the scheduler waits; bench/results/lora.md run 15)."""

from __future__ import annotations

from bench.lora_schedule import replay


def test_waiting_before_a_drain_packs_the_load_into_fewer_fuller_steps():
    at_once, patient = replay(0), replay(2)  # the served benchmark's 160 requests
    for run in (at_once, patient):
        # 32 clients: a decode step never runs more rows than that.
        assert run["decode_only_steps"] + run["prefill_steps"] == run["steps"]
        assert 0 < run["mean_decode_rows"] <= 32
    assert patient["steps"] < at_once["steps"]
    assert patient["mean_decode_rows"] > at_once["mean_decode_rows"]
    assert patient["steps_to_first_token_mean"] < at_once["steps_to_first_token_mean"]
