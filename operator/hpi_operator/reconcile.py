"""One idempotent reconcile: create, update, resume and inventory changes all come through here.

It decides (plan.py, pure), applies (children.py) and reports: the status to write, the Events to post and the
kopf error to raise, if any. The kopf handlers (handlers.py) only carry these out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from .cache import RETRY_BASE_DELAY_S
from .cache_sync import MODEL_CACHED, CacheReport, cache_status, collect_old_revision, sync_cache
from .children import apply_plan
from .kube import KubeClient, KubeError
from .network_policies import OperatorIdentity
from .nodes import NodeInfo
from .plan import Plan, make_plan
from .profile_sync import profile_events, profiled_condition, sync_profiles
from .profiling import RETRY_BASE_DELAY_S as PROFILE_RETRY_BASE_DELAY_S
from .profiling import PoolMeasurement
from .spec import SpecError
from .status import DEGRADED, READY, build_status, failed_status, pool_statuses


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Outcome:
    status: dict[str, Any]
    events: tuple[Event, ...] = ()
    error: Exception | None = None  # why the pass did not converge (kopf.PermanentError: only a new spec helps)
    result: str = "applied"  # for the operator's metrics: applied | unchanged | invalid | unplaceable | error


def _condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})


def _reported(old_status: Mapping[str, Any], message: str) -> bool:
    """The Degraded condition already says `message`: its Event was posted when it first did (one per cause,
    not one per resync)."""
    degraded = _condition(old_status, DEGRADED)
    return degraded.get("status") == "True" and degraded.get("message") == message


def _transition_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
    events = []
    failure = (new.get("modelCache") or {}).get("lastFailure")
    if failure and failure != (old.get("modelCache") or {}).get("lastFailure"):
        events.append(Event("Warning", "DownloadFailed", failure))  # once per failed attempt
    before, after = _condition(old, MODEL_CACHED), _condition(new, MODEL_CACHED)
    if after.get("status") == "True" and before.get("status") != "True":
        events.append(Event("Normal", "ModelCached", after["message"]))
    before, after = _condition(old, READY), _condition(new, READY)
    if after and after.get("status") != before.get("status"):
        events.append(Event("Normal" if after["status"] == "True" else "Warning", after["reason"], after["message"]))
    before, after = _condition(old, DEGRADED), _condition(new, DEGRADED)
    if after.get("status") == "True" and (before.get("status"), before.get("reason")) != ("True", after["reason"]):
        events.append(Event("Warning", after["reason"], after["message"]))
    return events


def unplaceable_message(plan: Plan) -> str:
    if not plan.choices:
        return "no usable nodes: every node is NotReady, unschedulable, untolerated or outside the nodeSelector"
    reasons = "; ".join(f"{c.pool.name}: {c.reason}" for c in plan.choices)
    return f"no node pool can serve this model: {reasons}"


def _with_served_path(body: Mapping[str, Any], path: str | None) -> dict[str, Any]:
    status = dict(body.get("status") or {})
    status["modelCache"] = {**(status.get("modelCache") or {}), "servedPath": path}
    return {**body, "status": status}


def reconcile(
    body: Mapping[str, Any],
    nodes: Iterable[NodeInfo],
    kube: KubeClient,
    now: str,
    cache_retry_base_s: float = RETRY_BASE_DELAY_S,
    profile_retry_base_s: float = PROFILE_RETRY_BASE_DELAY_S,
    operator: OperatorIdentity | None = None,
) -> Outcome:
    """Bring the children of `body` to the plan for the current inventory; never raises for bad input.
    `operator`: the operator's own pod, for the network policies (make_plan)."""
    metadata = body.get("metadata") or {}
    old_status = body.get("status") or {}
    generation = int(metadata.get("generation") or 0)
    try:
        plan = make_plan(body, nodes, operator=operator)
    except SpecError as e:
        # No child is touched: a typo in the spec must not take a working service down.
        status = failed_status(generation, old_status, now, "InvalidSpec", str(e))
        events = () if _reported(old_status, str(e)) else (Event("Warning", "InvalidSpec", str(e)),)
        return Outcome(status, events, kopf.PermanentError(str(e)), "invalid")
    if not plan.placeable:
        # Running children are left alone: a typo in the spec must not take a working service down.
        message = unplaceable_message(plan)
        status = failed_status(generation, old_status, now, "NoFittingPool", message)
        status.update(pools=pool_statuses(plan, {}), appliedHash=plan.fingerprint, profile="-")
        events = () if _reported(old_status, message) else (Event("Warning", "NoFittingPool", message),)
        return Outcome(status, events, kopf.PermanentError(message), "unplaceable")
    report: CacheReport | None = None
    measurements: dict[str, PoolMeasurement] = {}
    try:
        if plan.cache is not None:
            old_cache = old_status.get("modelCache") or {}
            report = sync_cache(kube, plan, metadata.get("uid"), old_cache, now, cache_retry_base_s)
            if report.served_path != plan.cached_dir:  # the fill Job just completed: pods move to it
                body = _with_served_path(body, report.served_path)
                plan = make_plan(body, nodes, operator=operator)
        # Also without targets: it deletes the profiling Jobs of pools (or of a profiling mode) no longer wanted.
        measurements = sync_profiles(kube, plan, metadata.get("uid"), old_status, now, profile_retry_base_s)
        measured = {pool: m.profile for pool, m in measurements.items() if m.profile is not None}
        if measured != dict(plan.measured):  # figures newly measured (or cached): the pools' ConfigMaps follow
            plan = make_plan(body, nodes, measured=measured, operator=operator)
        applied = apply_plan(kube, plan, metadata.get("uid"))
        if report is not None:
            report = collect_old_revision(kube, plan, applied.states, report)
    except KubeError as e:
        transient = e.status in (409, 429) or e.status >= 500
        message = f"applying children failed: {e}"
        status = failed_status(generation, old_status, now, "ApplyFailed", message)
        events = () if transient or _reported(old_status, message) else (Event("Warning", "ApplyFailed", message),)
        return Outcome(status, events, kopf.TemporaryError(message), "error")
    cache = cache_status(plan, report) if report is not None else None
    profiled = profiled_condition(plan, measurements) if plan.spec.profiled and plan.deployments else None
    status = build_status(plan, applied.states, generation, old_status, now, cache, measurements, profiled,
                          applied.missing)
    changes = [f"{action} {name}" for name, action in applied.actions.items() if action != "unchanged"]
    events = [Event("Normal", "Applied", "; ".join(changes))] if changes else []
    events += _transition_events(old_status, status)
    events += [Event(*event) for event in profile_events(old_status, measurements)]
    return Outcome(status, tuple(events), None, "applied" if changes else "unchanged")
