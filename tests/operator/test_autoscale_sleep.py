"""Scale to sleep (scaleToZero.sleepLevel), poll by poll: the builtin scaler's decision to go to zero puts the pods
to sleep instead of scaling them away, demand wakes them, the resource remembers which pods sleep, and a failed
call is retried. The pods' calls go to a recording caller here; test_autoscale_sleep_kmock.py runs the operator."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from hpi_operator.autoscaling.decision import PodLoad
from hpi_operator.autoscaling.loop import ANNOTATION_WAITING_REQUESTS, poll
from hpi_operator.autoscaling.scrape import PodTarget, Scraped, ScrapeResult
from hpi_operator.autoscaling.sleep import (
    PodCall,
    SleepPlan,
    SleepState,
    next_state,
    plan_sleep,
    sleep_from_status,
    sleep_to_status,
)
from hpi_operator.spec import AutoscalingSpec, SpecError, parse_spec
from hpi_testing.kube_emulator import merge_patch

SLEEPY = AutoscalingSpec(enabled=True, min_replicas=0, max_replicas=6, scale_down_stabilization_s=60, max_scale_step=2,
                         poll_interval_s=15, scale_to_zero=True, scale_to_zero_idle_s=30, sleep_level=2)  # fmt: skip


def targets(n: int) -> list[PodTarget]:
    return [PodTarget(f"p{i}", f"http://10.0.0.{i}:8000/metrics") for i in range(n)]


def fake_scraper(kv_by_pod: dict[str, float]):
    async def scrape(pods: Sequence[PodTarget]) -> list[ScrapeResult]:
        return [Scraped(t.pod, PodLoad(t.pod, kv_by_pod[t.pod])) for t in pods]

    return scrape


def merge(status: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """kopf's status patch as the API server applies it (the emulator's RFC 7386), then a JSON round trip."""
    return json.loads(json.dumps(merge_patch(status, patch)))


class Caller:
    """Records the POSTs; answers ok unless the pod is listed in `failing`."""

    def __init__(self, failing: Sequence[str] = ()) -> None:
        self.calls: list[tuple[str, str]] = []
        self.failing = set(failing)

    async def __call__(self, pods: Sequence[PodTarget], path: str) -> list[PodCall]:
        self.calls += [(t.pod, path) for t in pods]
        return [PodCall(t.pod, t.pod not in self.failing, "409: busy" if t.pod in self.failing else "") for t in pods]


async def test_idle_pool_sleeps_in_place_and_a_queued_request_wakes_it() -> None:
    pods, caller, status = targets(2), Caller(), {}
    idle = fake_scraper({"p0": 0.0, "p1": 0.0})
    for now in (1000.0, 1040.0):  # the idle clock starts at the first poll; 40 s > idleSeconds
        result = await poll(SLEEPY, 2, status, {}, pods, now, idle, running=pods, caller=caller)
        status = merge(status, result.status)
    assert result.scale_to is None, "the pods stay: they sleep"
    assert caller.calls == [("p0", "/sleep?level=2"), ("p1", "/sleep?level=2")]
    assert result.decision.reason == "ScaledToSleep"
    assert status["autoscaling"]["sleep"] == {"level": 2, "pods": ["p0", "p1"], "sinceEpoch": 1040}

    # Asleep, the pods are not ready: no scrape target, still running. Nothing waits: they stay asleep.
    caller.calls.clear()
    result = await poll(SLEEPY, 2, status, {}, [], 1060.0, idle, running=pods, caller=caller)
    status = merge(status, result.status)
    assert caller.calls == [] and result.scale_to is None and status["autoscaling"]["sleep"]["pods"] == ["p0", "p1"]

    # A request waits in front of them (the annotation here; the router's queue alike): every sleeper is woken.
    waiting = {ANNOTATION_WAITING_REQUESTS: "1"}
    result = await poll(SLEEPY, 2, status, waiting, [], 1075.0, idle, running=pods, caller=caller)
    status = merge(status, result.status)
    assert caller.calls == [("p0", "/wake_up"), ("p1", "/wake_up")]
    assert result.scale_to is None and result.decision.reason == "WokeUp"
    assert "sleep" not in status["autoscaling"]


async def test_a_failed_call_is_retried_and_a_new_pod_joins_the_sleepers() -> None:
    pods, caller = targets(2), Caller(failing=["p1"])
    status = {"autoscaling": {"lastActiveEpoch": 900}}
    result = await poll(SLEEPY, 2, status, {}, pods, 1000.0, fake_scraper({"p0": 0.0, "p1": 0.0}), running=pods,
                        caller=caller)  # fmt: skip
    status = merge(status, result.status)
    assert status["autoscaling"]["sleep"]["pods"] == ["p0"]  # p1 was busy (409): still awake, still ready
    caller.failing.clear()
    result = await poll(SLEEPY, 2, status, {}, pods[1:], 1015.0, fake_scraper({"p1": 0.0}), running=pods,
                        caller=caller)  # fmt: skip
    status = merge(status, result.status)
    assert caller.calls[-1] == ("p1", "/sleep?level=2")
    assert status["autoscaling"]["sleep"] == {"level": 2, "pods": ["p0", "p1"], "sinceEpoch": 1000}


async def test_scale_to_zero_without_sleep_still_scales_away() -> None:
    pods, caller = targets(1), Caller()
    status = {"autoscaling": {"lastActiveEpoch": 900}}
    result = await poll(replace(SLEEPY, sleep_level=0), 1, status, {}, pods, 1000.0, fake_scraper({"p0": 0.0}),
                        running=pods, caller=caller)  # fmt: skip
    assert result.scale_to == 0 and caller.calls == [] and result.status["autoscaling"]["sleep"] is None


async def test_pods_a_former_setting_put_to_sleep_are_woken() -> None:
    pods, caller = targets(1), Caller()
    status = {"autoscaling": {"sleep": {"level": 1, "pods": ["p0", "gone"], "sinceEpoch": 5}}}
    result = await poll(replace(SLEEPY, sleep_level=0), 1, status, {}, [], 1000.0, fake_scraper({}), running=pods,
                        caller=caller)  # fmt: skip
    assert caller.calls == [("p0", "/wake_up")]  # the pod that no longer exists is forgotten, not called
    assert result.status["autoscaling"]["sleep"] is None


def test_state_round_trips_and_mangled_status_reads_as_none() -> None:
    state = SleepState(1, ("a", "b"), 12.5)
    assert sleep_from_status({"sleep": sleep_to_status(state)}) == state
    for mangled in (None, {}, {"sleep": "x"}, {"sleep": {"pods": "a"}}, {"sleep": {"pods": [], "level": 1}},
                    {"sleep": {"pods": ["a"], "level": "high"}}):  # fmt: skip
        assert sleep_from_status(mangled) is None


def test_plan_sleeps_the_awake_and_wakes_only_running_sleepers() -> None:
    running = targets(3)
    plan = plan_sleep(2, True, SleepState(2, ("p0",), 1.0), ["p1", "p2"], running)
    assert [t.pod for t in plan.sleep] == ["p1", "p2"] and plan.wake == ()
    plan = plan_sleep(2, False, SleepState(2, ("p0", "p9"), 1.0), [], running)
    assert [t.pod for t in plan.wake] == ["p0"] and plan.sleep == ()
    state = next_state(SleepPlan(2, wake=(running[0],)), SleepState(2, ("p0",), 1.0), [PodCall("p0", False, "x")],
                       running, 2.0)  # fmt: skip
    assert state == SleepState(2, ("p0",), 1.0)  # the wake failed: still asleep, retried next poll


@pytest.mark.parametrize(
    ("autoscaling", "extra", "message"),
    [
        ({"scaleToZero": {"enabled": True, "sleepLevel": 3}}, {}, "must be 0, 1 or 2"),
        ({"mode": "keda", "scaleToZero": {"enabled": True, "sleepLevel": 1}}, {}, "needs mode builtin"),
        ({"scaleToZero": {"enabled": True, "sleepLevel": 1}}, {"apiKeySecretRef": {"name": "k", "key": "key"}},
         "apiKeySecretRef"),
    ],
)  # fmt: skip
def test_sleep_level_is_checked(autoscaling: dict, extra: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec({"autoscaling": {"enabled": True, **autoscaling}, **extra})
    assert parse_spec({"autoscaling": {"enabled": True, "scaleToZero": {"sleepLevel": 2}}}).autoscaling.sleep_level == 2
