"""One poll of the builtin scaler as the kopf timer runs it: scrape -> decide -> what to write; and the
resource as its only memory (an operator restarted between polls continues the same trajectory)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hpi_operator.autoscaling.decision import PodLoad
from hpi_operator.autoscaling.loop import (
    ANNOTATION_WAITING_REQUESTS,
    builtin_active,
    external_waiting,
    poll,
    poll_due,
    rfc3339,
)
from hpi_operator.autoscaling.scrape import UNREACHABLE, PodTarget, Scraped, ScrapeFailed, ScrapeResult
from hpi_operator.spec import AutoscalingSpec, parse_spec
from hpi_testing.kube_emulator import merge_patch

SETTINGS = AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=6, scale_down_stabilization_s=60,
                           max_scale_step=2, poll_interval_s=15)  # fmt: skip


def fake_scraper(kv_by_pod: dict[str, float | None]):
    async def scrape(targets: Sequence[PodTarget]) -> list[ScrapeResult]:
        out: list[ScrapeResult] = []
        for t in targets:
            kv = kv_by_pod.get(t.pod)
            if kv is None:
                out.append(ScrapeFailed(t.pod, UNREACHABLE, "connection refused"))
            else:
                out.append(Scraped(t.pod, PodLoad(t.pod, kv, 0, 3 if kv else 0)))
        return out

    return scrape


def targets(n: int) -> list[PodTarget]:
    return [PodTarget(f"p{i}", f"http://10.0.0.{i}:8000/metrics") for i in range(n)]


def merge(status: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """kopf's status patch as the API server applies it (the emulator's RFC 7386), then a JSON round trip."""
    return json.loads(json.dumps(merge_patch(status, patch)))


async def test_poll_scales_up_and_writes_status() -> None:
    result = await poll(SETTINGS, 2, {}, {}, targets(2), 1000.0, fake_scraper({"p0": 0.95, "p1": 0.9}))
    assert result.scale_to == 4
    status = result.status
    assert status["kvCacheUtilization"] == 0.925
    decision = status["autoscaling"]["lastDecision"]
    assert decision["fromReplicas"] == 2 and decision["replicas"] == 4 and decision["reason"] == "ScaledUp"
    assert status["autoscaling"]["numUnreachablePods"] == 0 and status["autoscaling"]["failedPods"] is None
    assert status["autoscaling"]["lastScaleTime"] == rfc3339(1000.0)
    json.dumps(status)  # JSON-safe: it goes into a merge patch as is


async def test_poll_reports_unreachable_pods_and_holds() -> None:
    result = await poll(replace(SETTINGS, scale_down_stabilization_s=0), 3, {}, {}, targets(3), 0.0,
                        fake_scraper({"p0": 0.05, "p1": None, "p2": 0.05}))  # fmt: skip
    assert result.scale_to is None
    auto = result.status["autoscaling"]
    assert auto["numUnreachablePods"] == 1 and auto["numReadyPods"] == 3
    assert auto["failedPods"] == [{"pod": "p1", "kind": "unreachable", "detail": "connection refused"}]
    assert auto["lastDecision"]["reason"] == "MetricsMissing"


async def test_no_pods_no_scrape_and_kv_cleared() -> None:
    async def never(_: Sequence[PodTarget]) -> list[ScrapeResult]:
        raise AssertionError("nothing to scrape")

    result = await poll(SETTINGS, 2, {}, {}, [], 0.0, never)
    assert result.scale_to is None and result.status["kvCacheUtilization"] is None


async def test_restart_between_polls_follows_the_same_trajectory() -> None:
    """Two operators: one keeps running, one is replaced before every poll; both only see the resource."""
    trace = [0.95, 0.95, 0.8, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2, 0.1, 0.1, 0.1]

    async def run(restart_each_poll: bool) -> list[int]:
        replicas, status, seen = 2, {}, []
        for i, kv in enumerate(trace):
            now = 1_767_225_600.0 + 15 * i
            if restart_each_poll:
                status = json.loads(json.dumps(status))  # a new process: nothing survives but the resource
            result = await poll(SETTINGS, replicas, status, {}, targets(replicas), now,
                                fake_scraper({f"p{j}": kv for j in range(replicas)}))  # fmt: skip
            status = merge(status, result.status)
            replicas = result.scale_to if result.scale_to is not None else replicas
            seen.append(replicas)
        return seen

    kept, restarted = await run(False), await run(True)
    assert kept == restarted
    assert max(kept) > 2 and kept[-1] < max(kept)  # it went up, then (after the window) down


def test_poll_cadence_comes_from_the_resource() -> None:
    assert poll_due(None, SETTINGS, 100.0)
    assert not poll_due({"lastPollEpoch": 90.0}, SETTINGS, 100.0)
    assert poll_due({"lastPollEpoch": 85.0}, SETTINGS, 100.0)
    assert poll_due({"lastPollEpoch": 85.5}, SETTINGS, 100.0, slack_s=0.5)
    assert poll_due({"lastPollEpoch": "garbage"}, SETTINGS, 100.0)


def test_external_waiting_annotation() -> None:
    assert external_waiting({ANNOTATION_WAITING_REQUESTS: "3"}) == 3
    assert external_waiting({ANNOTATION_WAITING_REQUESTS: "-1"}) == 0
    assert external_waiting(None) == 0


def test_only_builtin_mode_polls() -> None:
    assert builtin_active(parse_spec({"autoscaling": {"enabled": True}}).autoscaling)
    assert not builtin_active(parse_spec({"autoscaling": {"enabled": True, "mode": "hpa"}}).autoscaling)
    assert not builtin_active(parse_spec({}).autoscaling)


async def test_wake_from_zero_on_the_annotation() -> None:
    spec = replace(SETTINGS, min_replicas=0, scale_to_zero=True)
    asleep = await poll(spec, 0, {}, {}, [], 0.0)
    assert asleep.scale_to is None
    woken = await poll(spec, 0, {}, {ANNOTATION_WAITING_REQUESTS: "2"}, [], 15.0)
    assert woken.scale_to == 1 and woken.status["autoscaling"]["lastDecision"]["reason"] == "ScaledFromZero"


def test_the_timer_runs_only_for_builtin_specs() -> None:
    from hpi_operator.autoscaling.handlers import wants_builtin

    assert wants_builtin({"autoscaling": {"enabled": True}})
    assert not wants_builtin({"autoscaling": {"enabled": True, "mode": "keda"}})
    assert not wants_builtin({})
    assert not wants_builtin({"autoscaling": {"enabled": True, "minReplicas": 0}})  # invalid: no scaleToZero
