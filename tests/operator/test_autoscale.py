"""The builtin autoscaler's pure decision over synthetic metric sequences, its invariants (hypothesis), and
its memory's round trip through the resource (a restarted operator decides the same)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpi_operator.autoscaling.decision import (
    SATURATION_KV,
    Decision,
    History,
    Observation,
    PodLoad,
    decide,
    history_from_status,
    history_to_status,
)
from hpi_operator.spec import AutoscalingSpec

POLL_S = 15
BASE = AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=8, target_kv_utilization=0.7,
                       scale_down_stabilization_s=300, max_scale_step=2, poll_interval_s=POLL_S)  # fmt: skip


def pods(*kv: float, running: float = 4, waiting: float = 0) -> Observation:
    return Observation(tuple(PodLoad(f"p{i}", u, waiting, running if u > 0 else 0) for i, u in enumerate(kv)))


def uniform(n: int, kv: float, **kw: float) -> Observation:
    return pods(*([kv] * n), **kw)


def replay(
    spec: AutoscalingSpec, start: int, per_pod_kv: Sequence[float], history: History | None = None, t0: float = 0
) -> tuple[list[int], list[Decision]]:
    """Feed one per-pod utilisation per poll (every pod of the current replicas reports it)."""
    current, history = start, history or History()
    replicas, decisions = [], []
    for i, kv in enumerate(per_pod_kv):
        d = decide(spec, current, uniform(current, kv) if current else Observation(), history, t0 + i * POLL_S)
        current, history = d.desired_replicas, d.history
        replicas.append(current)
        decisions.append(d)
    return replicas, decisions


def load_model(spec: AutoscalingSpec, start: int, demand: Sequence[float]) -> list[int]:
    """Pods share a total KV demand (in whole-pod units): utilisation = demand / replicas, capped at 1."""
    current, history, replicas = start, History(), []
    for i, units in enumerate(demand):
        per_pod = units / current if current else 0.0
        waiting = max(0.0, units - current) * 10
        obs = uniform(current, min(1.0, per_pod), waiting=waiting / max(current, 1)) if current else Observation()
        d = decide(spec, current, obs, history, i * POLL_S)
        current, history = d.desired_replicas, d.history
        replicas.append(current)
    return replicas


# -- the rule itself --------------------------------------------------------------------------------------------


def test_proportional_to_utilisation_over_target() -> None:
    d = decide(BASE, 2, uniform(2, 0.9), History(), 0)
    assert d.desired_replicas == 3 and d.reason == "ScaledUp"  # ceil(2 * 0.9 / 0.7) = 3
    assert d.kv_utilization == pytest.approx(0.9)
    assert "above target" in d.message


def test_within_tolerance_band_nothing_moves() -> None:
    for kv in (0.64, 0.7, 0.76):
        d = decide(BASE, 4, uniform(4, kv), History(), 0)
        assert (d.desired_replicas, d.reason) == (4, "Steady")


def test_saturation_scales_up_by_a_full_step_even_if_the_mean_is_modest() -> None:
    # One pod full, the other nearly empty: the mean (0.5) is below target, but the full pod's demand is hidden.
    d = decide(BASE, 2, pods(0.99, 0.01), History(), 0)
    assert d.desired_replicas == 4 and "saturated" in d.message


def test_waiting_queue_scales_up_on_the_estimated_demand_without_a_waiting_target() -> None:
    # 3 pods at 60% KV with 4 running each and 2 waiting each: the queue would take 6 * 0.15 = 0.9 more pods'
    # worth of KV -> (1.8 + 0.9) / 0.7 -> 4 replicas.
    d = decide(BASE, 3, uniform(3, 0.6, waiting=2), History(), 0)
    assert d.desired_replicas == 4 and "waiting" in d.message
    # A long queue asks for much more, bounded by the step.
    assert decide(BASE, 3, uniform(3, 0.9, waiting=40), History(), 0).desired_replicas == 5
    # One queued request still adds a pod, even inside the tolerance band.
    assert decide(BASE, 3, uniform(3, 0.7, waiting=0.34), History(), 0).desired_replicas == 4
    # Waiting but nothing running (a stuck engine): a full step.
    assert decide(BASE, 2, uniform(2, 0.0, waiting=3), History(), 0).desired_replicas == 4


def test_waiting_target_is_proportional_per_pod() -> None:
    spec = replace(BASE, target_waiting_requests=4, max_scale_step=10)
    assert decide(spec, 2, uniform(2, 0.7, waiting=3), History(), 0).desired_replicas == 2  # under 4 per pod
    assert decide(spec, 2, uniform(2, 0.7, waiting=12), History(), 0).desired_replicas == 6  # 24 / 4


def test_pods_still_starting_do_not_cause_a_scale_down_or_runaway() -> None:
    # 4 desired, 2 ready and hot: ceil(2 * 0.9 / 0.7) = 3 < 4, but utilisation above target never scales down.
    assert decide(replace(BASE, scale_down_stabilization_s=0), 4, uniform(2, 0.9), History(), 0).desired_replicas == 4
    # Saturated with 2 more already starting: ready + step = 4, nothing more until they are up.
    assert decide(BASE, 4, uniform(2, 1.0), History(), 0).desired_replicas == 4


def test_min_and_max_clamps() -> None:
    assert decide(BASE, 8, uniform(8, 1.0), History(), 0).desired_replicas == 8
    assert decide(replace(BASE, scale_down_stabilization_s=0), 1, uniform(1, 0.0), History(), 0).desired_replicas == 1
    # A current count outside the bounds (the user edited min/max) goes straight to the bound.
    assert decide(BASE, 12, uniform(12, 0.7), History(), 0).desired_replicas == 8
    assert decide(replace(BASE, min_replicas=5), 1, uniform(1, 0.7), History(), 0).desired_replicas == 5


def test_step_limit_bounds_each_decision() -> None:
    spec = replace(BASE, max_replicas=20, max_scale_step=3, target_waiting_requests=1)
    d = decide(spec, 2, uniform(2, 1.0, waiting=50), History(), 0)  # 100 waiting / 1 per pod -> 100 replicas
    assert d.desired_replicas == 5 and "per step" in d.message
    spec = replace(spec, scale_down_stabilization_s=0)
    assert decide(spec, 10, uniform(10, 0.05), History(), 0).desired_replicas == 7


# -- traces -----------------------------------------------------------------------------------------------------


def test_ramp_up_climbs_by_steps_until_under_target() -> None:
    demand = [0.5 + 0.25 * i for i in range(20)] + [5.0] * 10  # up to 5 pods' worth of KV
    replicas = load_model(BASE, 1, demand)
    assert replicas == sorted(replicas), "a ramp never scales down"
    final = replicas[-1]
    assert 5.0 / final <= 0.7 * 1.1 < 5.0 / (final - 1)  # the fewest replicas within the tolerance band (7)
    assert all(b - a <= BASE.max_scale_step for a, b in zip(replicas, replicas[1:], strict=False))


def test_spike_scales_up_at_once_and_down_only_after_the_window() -> None:
    spec = replace(BASE, scale_down_stabilization_s=120)
    demand = [1.0] * 4 + [5.0] * 3 + [1.0] * 20
    replicas = load_model(spec, 2, demand)
    assert replicas[4] == 4 and max(replicas) >= 6  # saturated: a full step per poll
    peak_at = replicas.index(max(replicas))
    down_at = next(i for i in range(peak_at, len(replicas)) if replicas[i] < max(replicas))
    # The spike ended at poll 7; the highest recommendation stays in the window for 120 s = 8 polls.
    assert (down_at - 6) * POLL_S >= 120
    assert replicas[-1] == 2


def test_slow_decline_steps_down_after_the_window() -> None:
    demand = [5.0 - 0.1 * i for i in range(45)]  # 5 -> 0.6 units over 11 minutes
    replicas = load_model(BASE, 8, demand)
    assert replicas[:20] == [8] * 20  # 300 s window: 20 polls before anything goes
    assert replicas == sorted(replicas, reverse=True)
    assert replicas[-1] < 8
    assert all(a - b <= BASE.max_scale_step for a, b in zip(replicas, replicas[1:], strict=False))


def test_oscillating_load_around_the_target_does_not_flap() -> None:
    demand = [2.4, 3.4, 2.2, 3.6, 2.4, 3.3] * 15  # with 4 pods: 0.55..0.9 per pod, across the target each poll
    replicas = load_model(BASE, 4, demand)
    changes = sum(a != b for a, b in zip(replicas, replicas[1:], strict=False))
    assert max(replicas) - min(replicas) <= 2
    assert changes <= 2, replicas  # it may settle higher, but never goes back down within the window


def test_scale_to_zero_after_the_idle_window_and_back_on_a_waiting_request() -> None:
    spec = replace(BASE, min_replicas=0, scale_to_zero=True, scale_to_zero_idle_s=120, scale_down_stabilization_s=60)
    history, current, seen = History(), 2, []
    for i in range(20):
        obs = uniform(current, 0.0) if current else Observation()
        d = decide(spec, current, obs, history, i * POLL_S)
        current, history = d.desired_replicas, d.history
        seen.append((current, d.reason))
    counts = [c for c, _ in seen]
    first_zero = counts.index(0)
    assert first_zero * POLL_S >= 120, "not before the idle window"
    assert all(c >= 1 for c in counts[:first_zero]) and counts[first_zero:] == [0] * (20 - first_zero)
    assert "ScaledToZero" in {r for _, r in seen}
    # At zero there are no pods to read: demand comes from in front of them.
    d = decide(spec, 0, Observation(num_external_waiting=1), history, 20 * POLL_S)
    assert (d.desired_replicas, d.reason) == (1, "ScaledFromZero")
    # Nothing waiting: stays at zero, even with no memory at all (a fresh operator must not wake it).
    assert decide(spec, 0, Observation(), History(), 0).desired_replicas == 0


def test_activity_resets_the_idle_clock() -> None:
    spec = replace(BASE, min_replicas=0, scale_to_zero=True, scale_to_zero_idle_s=60, scale_down_stabilization_s=0)
    history = decide(spec, 1, uniform(1, 0.0), History(), 0).history
    history = decide(spec, 1, uniform(1, 0.0), history, 45).history
    busy = decide(spec, 1, uniform(1, 0.3), history, 50)  # a request arrives
    assert busy.history.last_active_s == 50
    assert decide(spec, 1, uniform(1, 0.0), busy.history, 100).desired_replicas == 1  # 50 s idle < 60
    assert decide(spec, 1, uniform(1, 0.0), busy.history, 111).desired_replicas == 0


def test_unreachable_pods_block_scale_down_and_are_reported() -> None:
    spec = replace(BASE, scale_down_stabilization_s=0)
    obs = Observation(loads=(PodLoad("p0", 0.05), PodLoad("p1", 0.05)), num_failed=2)
    d = decide(spec, 4, obs, History(), 0)
    assert d.desired_replicas == 4 and d.reason == "MetricsMissing" and d.num_failed == 2
    assert "blocked" in d.message
    # Not zero load either: with everything unreadable, nothing moves.
    assert decide(spec, 4, Observation(num_failed=4), History(), 0).desired_replicas == 4
    # But a hot readable pod still scales up (unreadable ones are assumed at the mean, not at zero).
    hot = Observation(loads=(PodLoad("p0", 0.95, 0, 8),), num_failed=1)
    assert decide(spec, 2, hot, History(), 0).desired_replicas == 4


def test_unreachable_pods_keep_the_idle_clock_running() -> None:
    spec = replace(BASE, min_replicas=0, scale_to_zero=True, scale_to_zero_idle_s=30, scale_down_stabilization_s=0)
    history = History(last_active_s=0)
    d = decide(spec, 1, Observation(num_failed=1), history, 1000)
    assert d.desired_replicas == 1 and d.history.last_active_s == 1000


def test_scale_up_stabilization_window_takes_the_lowest_recommendation() -> None:
    spec = replace(BASE, scale_up_stabilization_s=30, max_scale_step=10)
    replicas, _ = replay(spec, 2, [0.7, 1.0, 1.0, 1.0])
    assert replicas[1] == 2  # one hot poll is not enough
    assert replicas[3] > 2


def test_cooldown_after_a_scale_up_survives_in_history() -> None:
    spec = replace(BASE, scale_down_stabilization_s=60)
    up = decide(spec, 2, uniform(2, 0.95), History(), 0)
    assert up.desired_replicas == 4
    # Even with the window's recommendations lost, the last scale-up time holds the scale-down.
    only_times = History(last_scale_up_s=up.history.last_scale_up_s, last_active_s=0)
    assert decide(spec, 4, uniform(4, 0.1), only_times, 30).desired_replicas == 4
    assert decide(spec, 4, uniform(4, 0.1), only_times, 61).desired_replicas == 2


# -- invariants -----------------------------------------------------------------------------------------------

spec_strategy = st.builds(
    lambda lo, span, step, down, up, zero, target: AutoscalingSpec(
        enabled=True, min_replicas=lo, max_replicas=max(lo, 1) + span, max_scale_step=step,
        scale_down_stabilization_s=down, scale_up_stabilization_s=up, target_kv_utilization=target,
        scale_to_zero=zero or lo == 0, scale_to_zero_idle_s=60, poll_interval_s=POLL_S,
    ),
    st.integers(0, 4), st.integers(0, 8), st.integers(1, 4), st.sampled_from([0, 30, 120, 300]),
    st.sampled_from([0, 0, 30]), st.booleans(), st.sampled_from([0.5, 0.7, 0.9]),
)  # fmt: skip
poll_strategy = st.tuples(
    st.lists(st.floats(0.0, 1.0), max_size=6),  # readable pods' KV (pod count is capped by current below)
    st.integers(0, 2),  # unreachable pods
    st.integers(0, 3),  # waiting per pod
    st.integers(0, 2),  # external waiting
)


@settings(max_examples=150, deadline=None)
@given(spec=spec_strategy, polls=st.lists(poll_strategy, min_size=1, max_size=40), start=st.integers(0, 12))
def test_invariants_over_random_traces(spec: AutoscalingSpec, polls: list, start: int) -> None:
    floor = max(spec.min_replicas, 1)
    current, history = start, History()
    raw_seen: list[tuple[float, int]] = []
    for i, (kvs, failed, waiting, external) in enumerate(polls):
        now = i * POLL_S
        loads = tuple(PodLoad(f"p{j}", kv, waiting, 1 if kv else 0) for j, kv in enumerate(kvs[:current]))
        obs = Observation(loads, min(failed, current), external)
        d = decide(spec, current, obs, history, now)
        new = d.desired_replicas
        # 1. bounds: within [min, max], or 0 when scale-to-zero allows it
        assert new == 0 and spec.scale_to_zero or floor <= new <= spec.max_replicas
        # 2. step: at most max_scale_step, unless the bounds themselves force a bigger move
        in_bounds = floor <= current <= spec.max_replicas
        if in_bounds and new != 0:
            assert abs(new - current) <= spec.max_scale_step
        if new == 0:
            assert current == 0 or current - 0 <= spec.max_scale_step or not in_bounds
        # 3. never down within the scale-down window after a recommendation at least as high as current
        recent = [r for t, r in raw_seen if t > now - spec.scale_down_stabilization_s]
        if in_bounds and new < current:
            assert all(r < current for r in recent + [d.raw_replicas])
            assert obs.num_failed == 0  # 4. never down while a pod's metrics are missing
        raw_seen.append((now, d.raw_replicas))
        # 5. the memory round-trips through JSON and decides the same next time (restart)
        restored = history_from_status(json.loads(json.dumps(history_to_status(d.history))))
        assert restored == d.history
        current, history = new, d.history


# -- memory on the resource ---------------------------------------------------------------------------------------


def test_history_round_trip_and_a_restart_decides_the_same() -> None:
    demand = [0.9, 0.95, 0.5, 0.3, 0.2, 0.2, 0.1]
    uninterrupted, _ = replay(BASE, 2, demand)
    # An operator that restarts before every poll: it only has what the previous one wrote to status.
    current, status, restarted = 2, {}, []
    for i, kv in enumerate(demand):
        d = decide(BASE, current, uniform(current, kv), history_from_status(status.get("autoscaling")), i * POLL_S)
        status = json.loads(json.dumps({"autoscaling": history_to_status(d.history)}))
        current = d.desired_replicas
        restarted.append(current)
    assert restarted == uninterrupted


def test_history_from_a_mangled_status_is_empty_not_an_error() -> None:
    assert history_from_status(None) == History()
    assert history_from_status({"windowMax": "x", "windowMin": [[1, "a"], [2]], "lastScaleEpoch": "soon"}) == History()
    partial = history_from_status({"windowMax": [[30, 2], [10, 4]], "lastActiveEpoch": 5})
    assert [r.at_s for r in partial.window_max] == [10, 30] and partial.last_active_s == 5


def test_window_memory_stays_small_over_long_windows() -> None:
    spec = replace(BASE, scale_down_stabilization_s=86400)
    per_pod = [0.1 + 0.8 * ((i * 7919) % 100) / 100 for i in range(500)]
    _, decisions = replay(spec, 4, per_pod)
    history = decisions[-1].history
    assert len(history.window_max) <= spec.max_replicas + 8  # distinct values, not one entry per poll
    assert len(json.dumps(history_to_status(history))) < 2000


def test_saturation_threshold_is_below_full() -> None:
    assert 0.9 <= SATURATION_KV < 1.0
