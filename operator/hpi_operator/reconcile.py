"""One idempotent reconcile: create, update, resume and inventory changes all come through here.

It decides (plan.py, pure), applies (kube.py) and reports: the status to write, the Events to post and the
kopf error to raise, if any. The kopf handlers (handlers.py) only carry these out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from .autoscale_children import prune_autoscalers
from .kube import KubeClient, KubeError, apply_plan
from .nodes import NodeInfo
from .plan import Plan, make_plan
from .spec import SpecError
from .status import DEGRADED, READY, build_status, failed_status, pool_statuses

RETRY_DELAY_S = 15  # after a transient API failure (conflict, throttling, server error)
FORBIDDEN_RETRY_DELAY_S = 60  # after a 4xx the operator cannot fix itself (RBAC, admission webhooks)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Outcome:
    status: dict[str, Any]
    events: tuple[Event, ...] = ()
    error: Exception | None = None  # a kopf.PermanentError or kopf.TemporaryError to raise after writing status
    result: str = "applied"  # for the operator's metrics: applied | unchanged | invalid | unplaceable | error


def _condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})


def _transition_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
    events = []
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


def reconcile(
    body: Mapping[str, Any], nodes: Iterable[NodeInfo], kube: KubeClient, now: str
) -> Outcome:
    """Bring the children of `body` to the plan for the current inventory; never raises for bad input."""
    metadata = body.get("metadata") or {}
    old_status = body.get("status") or {}
    generation = int(metadata.get("generation") or 0)
    try:
        plan = make_plan(body, nodes)
    except SpecError as e:
        status = failed_status(generation, old_status, now, "InvalidSpec", str(e))
        return Outcome(status, (Event("Warning", "InvalidSpec", str(e)),), kopf.PermanentError(str(e)), "invalid")
    if not plan.placeable:
        # Running children are left alone: a typo in the spec must not take a working service down.
        message = unplaceable_message(plan)
        status = failed_status(generation, old_status, now, "NoFittingPool", message)
        status.update(pools=pool_statuses(plan, {}), appliedHash=plan.fingerprint, profile="-")
        already = _condition(old_status, DEGRADED).get("message") == message
        events = () if already else (Event("Warning", "NoFittingPool", message),)
        return Outcome(status, events, kopf.PermanentError(message), "unplaceable")
    try:
        applied = apply_plan(kube, plan, metadata.get("uid"))
        applied.actions.update(dict.fromkeys(prune_autoscalers(kube, plan, metadata.get("uid")), "deleted"))
    except KubeError as e:
        transient = e.status in (409, 429) or e.status >= 500
        message = f"applying children failed: {e}"
        status = failed_status(generation, old_status, now, "ApplyFailed", message)
        delay = RETRY_DELAY_S if transient else FORBIDDEN_RETRY_DELAY_S
        events = () if transient else (Event("Warning", "ApplyFailed", message),)
        return Outcome(status, events, kopf.TemporaryError(message, delay=delay), "error")
    status = build_status(plan, applied.states, generation, old_status, now)
    changes = [f"{action} {name}" for name, action in applied.actions.items() if action != "unchanged"]
    events = [Event("Normal", "Applied", "; ".join(changes))] if changes else []
    events += _transition_events(old_status, status)
    return Outcome(status, tuple(events), None, "applied" if changes else "unchanged")
