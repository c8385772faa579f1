"""One poll of the builtin autoscaler, between the kopf timer (handlers.py) and the pure decision.

scrape the ready pods -> `autoscale.decide` with the history read back from the resource and the demand waiting
in front of the pods (the router's queue, router_queue.py, or the annotation) -> the replicas to write (or None)
and the status to merge. Everything but the scrape is a pure function of its arguments, so
the poll is testable without kopf and a restarted operator reads the same memory back.
"""

from __future__ import annotations

import datetime
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..names import GROUP
from ..spec import AutoscalingSpec
from .decision import Decision, decide, history_from_status, history_to_status
from .router_queue import RouterQueue, router_status
from .scrape import PodTarget, ScrapeFailed, ScrapeResult, observation, scrape_pods, startup_by_pool
from .sleep import Caller, PodCall, carry_out, next_state, plan_sleep, sleep_from_status, sleep_to_status

# Demand seen in front of the pods (a gateway or activator holding requests while there are no replicas):
# an integer annotation on the InferenceDeployment; the builtin scaler wakes from zero when it is positive.
ANNOTATION_WAITING_REQUESTS = f"{GROUP}/waiting-requests"
MAX_REPORTED_FAILURES = 10

Scraper = Callable[[Sequence[PodTarget]], Awaitable[list[ScrapeResult]]]


@dataclass(frozen=True)
class PollResult:
    decision: Decision
    results: tuple[ScrapeResult, ...]
    scale_to: int | None  # the new spec.replicas, when it changes
    status: dict[str, Any]  # keys to merge into .status
    sleep_calls: tuple[PodCall, ...] = ()  # the /sleep and /wake_up calls made (scaleToZero.sleepLevel)


async def _no_pods(targets: Sequence[PodTarget], path: str) -> list[PodCall]:
    return [PodCall(t.pod, False, "no caller") for t in targets]


def rfc3339(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def builtin_active(settings: AutoscalingSpec) -> bool:
    return settings.enabled and settings.mode == "builtin"


def poll_due(status_autoscaling: Mapping[str, Any] | None, settings: AutoscalingSpec, now_s: float,
             slack_s: float = 0.0) -> bool:  # fmt: skip
    """Whether pollIntervalSeconds have passed since the last poll recorded on the resource.

    The timer ticks faster than any interval; the resource, not process memory, says when the last poll was,
    so a restarted operator keeps the cadence. `slack_s` (half a tick) keeps ticks from drifting a poll late.
    """
    last = (status_autoscaling or {}).get("lastPollEpoch") if isinstance(status_autoscaling, Mapping) else None
    try:
        return last is None or now_s - float(last) >= settings.poll_interval_s - slack_s
    except (TypeError, ValueError):
        return True


def external_waiting(annotations: Mapping[str, str] | None) -> int:
    raw = (annotations or {}).get(ANNOTATION_WAITING_REQUESTS, "")
    return int(raw) if str(raw).strip().isdigit() else 0


def external_demand(annotations: Mapping[str, str] | None, router: RouterQueue) -> int:
    """The requests waiting in front of the pods: the router's queue, or the annotation, whichever is larger.

    The larger, not the sum: a gateway that sets the annotation sits in front of the same router and counts the
    same requests (they pass through it to the router's queue), so adding them would count each request twice."""
    return max(external_waiting(annotations), router.num_queued)


def autoscaling_status(decision: Decision, current: int, results: Sequence[ScrapeResult], now_s: float,
                       router: RouterQueue = RouterQueue(),
                       startup: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The status keys one poll writes: `autoscaling` (memory, last decision, the router's queue, how the pods of
    each pool started) and `kvCacheUtilization`."""
    failures = [r for r in results if isinstance(r, ScrapeFailed)]
    memory = history_to_status(decision.history)
    kv = decision.kv_utilization
    return {
        "kvCacheUtilization": None if kv is None else round(kv, 4),
        "autoscaling": {
            **memory,
            "lastPollEpoch": round(now_s, 3),
            "lastScaleTime": None if decision.history.last_scale_s is None else rfc3339(decision.history.last_scale_s),
            "lastDecision": {
                "time": rfc3339(now_s),
                "fromReplicas": current,
                "replicas": decision.desired_replicas,
                "recommendedReplicas": decision.raw_replicas,
                "reason": decision.reason,
                "message": decision.message,
            },
            "numReadyPods": decision.num_ready,
            "numUnreachablePods": decision.num_failed,
            "failedPods": [
                {"pod": f.pod, "kind": f.kind, "detail": f.detail[:200]} for f in failures[:MAX_REPORTED_FAILURES]
            ]
            or None,
            **router_status(router),
            "startup": startup,
        },
    }


async def poll(
    settings: AutoscalingSpec,
    current: int,
    status: Mapping[str, Any],
    annotations: Mapping[str, str] | None,
    targets: Sequence[PodTarget],
    now_s: float,
    scraper: Scraper = scrape_pods,
    router: RouterQueue = RouterQueue(),
    running: Sequence[PodTarget] = (),
    caller: Caller = _no_pods,
) -> PollResult:
    """Scrape `targets`, decide, and say what to write. `current` is the resource's spec.replicas; `router`: what
    the router pods hold (already scraped), demand the runtime pods cannot see. With scaleToZero.sleepLevel,
    `running` (every running pod, ready or not) and `caller` (POSTs to pods) put the pods to sleep instead of
    scaling to zero, and wake them (sleep.py); pods a former setting put to sleep are woken either way."""
    results = tuple(await scraper(targets)) if targets else ()
    history = history_from_status(status.get("autoscaling"))
    state = sleep_from_status(status.get("autoscaling"))
    sleep_mode = settings.sleep_level > 0
    awake = 0 if state and sleep_mode else current  # sleeping pods serve nothing: the decision sees zero
    obs = observation(results, external_demand(annotations, router))
    decision = decide(settings, awake, obs, history, now_s)
    asleep = sleep_mode and decision.desired_replicas == 0
    scale_to = decision.desired_replicas if decision.desired_replicas != current else None
    if sleep_mode and (asleep or state):
        scale_to = None  # the pods stay: they sleep or wake instead
        decision = _as_sleep(decision, settings.sleep_level, current, waking=state is not None and not asleep)
    plan = plan_sleep(settings.sleep_level, asleep, state, [t.pod for t in targets], running)
    calls = tuple(await carry_out(plan, caller)) if plan.sleep or plan.wake else ()
    startup = startup_by_pool(results, targets)
    out = autoscaling_status(decision, current, results, now_s, router, startup)
    out["autoscaling"]["sleep"] = sleep_to_status(next_state(plan, state, calls, running, now_s))
    return PollResult(decision, results, scale_to, out, calls)


def _as_sleep(decision: Decision, level: int, current: int, waking: bool) -> Decision:
    """The decision as scale-to-sleep carries it out: the same replicas asleep or awake, not scaled."""
    if waking:
        return replace(decision, reason="WokeUp", message=f"waking {current} sleeping pod(s): {decision.message}")
    if decision.reason != "ScaledToZero":
        return decision
    return replace(decision, reason="ScaledToSleep",
                   message=f"{current} pod(s) to sleep at level {level}: {decision.message}")  # fmt: skip
