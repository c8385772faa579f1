"""Writing a Plan's children: server-side apply of each wanted child, one generic prune of the rest.

Every child is declared whole and applied with the field manager `hpi-operator` and `force`: the operator owns
every field it declares (a hand edit of one is reverted on the next reconcile) and nothing else (labels,
annotations or fields others add stay theirs). A child already in sync (drift.py) is not written at all.
Field ownership, as HPA and Deployments split it: the operator owns each child's fields, including the runtime
Deployments' spec.replicas; spec.replicas of the InferenceDeployment belongs to whoever scales it (the user,
the builtin autoscaler, an HPA or KEDA through the scale subresource), and the operator never writes it.

The prune deletes every object of PRUNED_KINDS that carries this InferenceDeployment's selector label and an
owner reference to it, and that the plan does not want (a dropped pool's profile ConfigMap among them). The model
cache's claim is never pruned (it holds downloaded weights; it goes with the resource) and its Jobs are
cache_sync.py's; the profiling Jobs are profile_sync.py's, and the profile cache's ConfigMaps carry neither
this label nor an owner: they outlive the resource on purpose (profiling.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .drift import in_sync
from .kube import KubeClient, KubeError, collection_path, object_path, with_query
from .manifests import label_selector
from .names import FIELD_MANAGER
from .plan import Plan
from .status import ChildState

APPLY_PATCH = "application/apply-patch+yaml"
RUNTIME_KINDS = ("Deployment", "LeaderWorkerSet")  # a pool's runtime pods: one per replica, or a group per replica
PRUNED_KINDS = ("Deployment", "LeaderWorkerSet", "Service", "PodDisruptionBudget", "ServiceAccount", "Role",
                "RoleBinding", "InferencePool", "HorizontalPodAutoscaler", "ScaledObject", "ConfigMap",
                "NetworkPolicy")  # fmt: skip


def apply_object(kube: KubeClient, desired: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Bring the child to `desired` (created when missing); returns the live object and what was done:
    created | applied | unchanged."""
    meta = desired["metadata"]
    path = object_path(desired["kind"], meta["namespace"], meta["name"])
    live = kube.get(path)
    if live is not None and (live.get("metadata") or {}).get("deletionTimestamp"):
        # A child of a pool that was dropped a moment ago and is back: wait until it is gone (409 -> retry).
        raise KubeError(409, f"{desired['kind']} {meta['name']} is still terminating")
    if live is not None and in_sync(desired, live):
        return live, "unchanged"
    applied = kube.request("PATCH", with_query(path, fieldManager=FIELD_MANAGER, force="true"), dict(desired),
                           APPLY_PATCH)  # fmt: skip
    return applied, "created" if live is None else "applied"


def _owned(item: Mapping[str, Any], owner_uid: str | None) -> bool:
    refs = (item.get("metadata") or {}).get("ownerReferences") or []
    return owner_uid is None or any(ref.get("uid") == owner_uid for ref in refs)


def prune(kube: KubeClient, plan: Plan, owner_uid: str | None) -> list[str]:
    """Delete the children of PRUNED_KINDS this InferenceDeployment owns that `plan` does not want (a dropped
    pool's Deployment, the router's objects after a switch of routing mode, an HPA after a switch to KEDA);
    returns "Kind/name" of each. A kind the cluster does not serve (no KEDA, no InferencePool CRD) answers 404:
    nothing of it to prune."""
    wanted = {(c["kind"], c["metadata"]["name"]) for c in plan.children}
    selector = label_selector(plan.owner.name)
    deleted = []
    for kind in PRUNED_KINDS:
        path = collection_path(kind, plan.owner.namespace)
        try:
            listing = kube.request("GET", with_query(path, labelSelector=selector))
        except KubeError as e:
            if e.status == 404:
                continue
            raise
        for item in listing.get("items") or []:
            name = (item.get("metadata") or {}).get("name")
            if _owned(item, owner_uid) and (kind, name) not in wanted:
                kube.request("DELETE", f"{path}/{name}", {"propagationPolicy": "Background"})
                deleted.append(f"{kind}/{name}")
    return deleted


@dataclass(frozen=True)
class ApplyResult:
    states: dict[str, ChildState]  # by Deployment (or LeaderWorkerSet) name
    actions: dict[str, str]  # "Kind/name" -> created | applied | unchanged | deleted
    # LeaderWorkerSets not written because the cluster does not serve that API (LWS not installed), by name.
    missing: tuple[str, ...] = ()


def apply_plan(kube: KubeClient, plan: Plan, owner_uid: str | None) -> ApplyResult:
    """Make the cluster match `plan`: apply every child, delete the children it no longer wants."""
    states: dict[str, ChildState] = {}
    actions: dict[str, str] = {}
    missing: list[str] = []
    for child in plan.children:
        try:
            live, action = apply_object(kube, child)
        except KubeError as e:
            if e.status != 404 or child["kind"] != "LeaderWorkerSet":
                raise
            missing.append(child["metadata"]["name"])  # no LWS API: the other pools still serve
            continue
        actions[f"{child['kind']}/{child['metadata']['name']}"] = action
        if child["kind"] in RUNTIME_KINDS:
            states[child["metadata"]["name"]] = ChildState.from_deployment(live)
    if plan.waiting_for_cache:  # running pods (cache just enabled) stay for now
        return ApplyResult(states=states, actions=actions, missing=tuple(missing))
    actions.update(dict.fromkeys(prune(kube, plan, owner_uid), "deleted"))
    return ApplyResult(states=states, actions=actions, missing=tuple(missing))
