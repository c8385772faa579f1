"""Scale to sleep (spec.autoscaling.scaleToZero.sleepLevel 1 or 2): where the builtin scaler would scale an idle
pool to zero, it keeps the pods (and their nodes) and puts them to sleep through the runtime's vLLM endpoints,
`POST /sleep?level=N`; when demand returns (the router's queue, as a wake from zero) it calls `POST /wake_up`.

A sleeping runtime answers /ready with 503, so its pod turns not ready and leaves the Services and the router's
backends: it gets no traffic. The operator finds it anyway, through an index of every running pod with an address
(`running_pod_targets`), and it knows which pods sleep from the resource itself (status.autoscaling.sleep), never
from memory: a restarted operator wakes the pods its predecessor put to sleep.

Level-based, each poll: while the decision is "zero", every awake (ready) pod is put to sleep, so a pod that
started or restarted meanwhile joins the others; once it is not, every pod listed as sleeping that still exists
is woken. A call that fails (a busy engine answers 409, an unreachable pod) leaves that pod's state as it was,
and the next poll tries again. Pods with an API key (spec.apiKeySecretRef) want it on these endpoints too, and
the operator holds no right to read Secrets (by design: tests/chart/test_rbac.py), so the spec refuses
sleepLevel with apiKeySecretRef (spec.py) rather than calling pods that would answer 401.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from .scrape import PodTarget

DEFAULT_TIMEOUT_S = 60.0  # a level-2 wake reloads the weights: seconds on CPU, more for a large model on a GPU


@dataclass(frozen=True)
class SleepState:
    """The pods asleep, as status.autoscaling.sleep records them."""

    level: int
    pods: tuple[str, ...]
    since_s: float  # when the first of them went to sleep (epoch seconds)


@dataclass(frozen=True)
class SleepPlan:
    """What one poll does to the pods."""

    level: int
    sleep: tuple[PodTarget, ...] = ()  # awake pods to put to sleep
    wake: tuple[PodTarget, ...] = ()  # sleeping pods to wake


@dataclass(frozen=True)
class PodCall:
    """One POST to a pod: whether it did what was asked, and what it answered otherwise."""

    pod: str
    ok: bool
    detail: str = ""


Caller = Callable[[Sequence[PodTarget], str], Awaitable[list[PodCall]]]  # (pods, path) -> one PodCall each


def sleep_from_status(status_autoscaling: Mapping[str, Any] | None) -> SleepState | None:
    """status.autoscaling.sleep -> SleepState; missing or mangled: None (nothing known to sleep)."""
    raw = (status_autoscaling or {}).get("sleep") if isinstance(status_autoscaling, Mapping) else None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("pods"), list):
        return None
    pods = tuple(sorted(str(p) for p in raw["pods"] if isinstance(p, str)))
    try:
        level, since_s = int(raw.get("level", 1)), float(raw.get("sinceEpoch", 0.0))
    except (TypeError, ValueError):
        return None
    return SleepState(level, pods, since_s) if pods else None


def sleep_to_status(state: SleepState | None) -> dict[str, Any] | None:
    """The value of status.autoscaling.sleep (None removes it: no pod sleeps)."""
    if state is None:
        return None
    return {"level": state.level, "pods": list(state.pods), "sinceEpoch": round(state.since_s, 3)}


def plan_sleep(level: int, asleep: bool, state: SleepState | None, ready: Sequence[str],
               running: Sequence[PodTarget]) -> SleepPlan:  # fmt: skip
    """`asleep`: the decision is zero replicas. Then sleep every ready (awake) pod; else wake every pod listed as
    sleeping that still runs. `running`: every running pod with an address, ready or not."""
    if asleep:
        return SleepPlan(level, sleep=tuple(t for t in running if t.pod in set(ready)))
    sleeping = set(state.pods) if state else set()
    return SleepPlan(level, wake=tuple(t for t in running if t.pod in sleeping))


def next_state(plan: SleepPlan, state: SleepState | None, calls: Sequence[PodCall], running: Sequence[PodTarget],
               now_s: float) -> SleepState | None:  # fmt: skip
    """The pods asleep after this poll's calls: those asleep before that still exist, plus the ones that went to
    sleep, minus the ones that woke."""
    done = {c.pod for c in calls if c.ok}
    alive = {t.pod for t in running}
    pods = (set(state.pods if state else ()) & alive) | {t.pod for t in plan.sleep if t.pod in done}
    pods -= {t.pod for t in plan.wake if t.pod in done}
    if not pods:
        return None
    since_s = state.since_s if state and state.pods else now_s
    return SleepState(state.level if state else plan.level, tuple(sorted(pods)), since_s)


def base_url(target: PodTarget) -> str:
    return target.url.removesuffix("/metrics")


async def _post(session: aiohttp.ClientSession, target: PodTarget, path: str, timeout_s: float) -> PodCall:
    try:
        async with session.post(base_url(target) + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            body = (await response.text())[:300]
            return PodCall(target.pod, response.status == 200, "" if response.status == 200 else
                           f"{response.status}: {body}")  # fmt: skip
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return PodCall(target.pod, False, f"unreachable: {e or type(e).__name__}")


async def call_pods(targets: Sequence[PodTarget], path: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[PodCall]:
    """POST `path` (/sleep?level=N or /wake_up) to every target concurrently."""
    if not targets:
        return []
    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(_post(session, t, path, timeout_s) for t in targets)))


async def carry_out(plan: SleepPlan, caller: Caller) -> list[PodCall]:
    """The plan's calls: /sleep?level=N to the pods to sleep, /wake_up to the pods to wake."""
    return [*await caller(plan.sleep, f"/sleep?level={plan.level}"), *await caller(plan.wake, "/wake_up")]
