"""The InferenceDeployment's status, computed purely from a Plan and the observed children.

Conditions follow the Kubernetes API conventions (type/status/reason/message/lastTransitionTime, and
lastTransitionTime only moves when status flips): Ready, Progressing, Degraded, ModelCached with a shared model
cache (its entry and condition come from cache_sync.py), PoolsProfiled where pools are measured (profile_sync.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .autoscaling.sleep import sleep_from_status
from .manifests import deployment_name, served_model_name
from .plan import Plan
from .profiling import PoolMeasurement, performance_status
from .sizing import active_parameters

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
SLO_ATTAINABLE = "SLOAttainable"  # with autoscaling mode optimizer: whether the replicas it chose meet spec.slo


@dataclass(frozen=True)
class ChildState:
    """What the operator needs from one Deployment it owns, or one LeaderWorkerSet (a pool whose replicas span
    nodes: its spec and status count groups with the same fields, observedGeneration included)."""

    name: str
    desired_replicas: int
    replicas: int
    ready_replicas: int
    updated_replicas: int
    rolled_out: bool  # the Deployment controller has seen the latest template

    @classmethod
    def from_deployment(cls, obj: Mapping[str, Any]) -> ChildState:
        status = obj.get("status") or {}
        generation = (obj.get("metadata") or {}).get("generation", 0)
        return cls(
            name=obj["metadata"]["name"],
            desired_replicas=int((obj.get("spec") or {}).get("replicas", 1)),
            replicas=int(status.get("replicas", 0)),
            ready_replicas=int(status.get("readyReplicas", 0)),
            updated_replicas=int(status.get("updatedReplicas", 0)),
            rolled_out=int(status.get("observedGeneration", 0)) >= int(generation),
        )


def slo_condition(status: Mapping[str, Any]) -> dict[str, str]:
    """SLOAttainable, from the fleet optimizer's last decision (status.autoscaling.optimizer)."""
    optimizer = ((status.get("autoscaling") or {}).get("optimizer") or {}) if isinstance(status, Mapping) else {}
    if "feasible" not in optimizer:
        return condition(SLO_ATTAINABLE, False, "NotYetDecided", "the fleet optimizer has not decided yet")
    observed = _observed(optimizer.get("slo"))
    if optimizer["feasible"]:
        return condition(SLO_ATTAINABLE, True, "WithinSLO",
                         "the chosen replicas meet spec.slo for the demand" + observed)  # fmt: skip
    reason = str(optimizer.get("reason") or "")
    code = "NoPoolFastEnough" if reason.startswith("no pool fast enough") else "InsufficientCapacity"
    return condition(SLO_ATTAINABLE, False, code, reason + observed)


def _observed(slo: Any) -> str:
    """The attainment the pods observed, for the condition's message: the condition itself says whether the plan
    can meet the SLO (a prediction), this what the last window delivered (a measured lower bound)."""
    if not isinstance(slo, Mapping) or not isinstance(slo.get("attainment"), (int, float)):
        return ""
    return f"; observed attainment >= {slo['attainment']:.1%} of {slo.get('requests', 0)} requests"


def condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def merge_conditions(
    old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, str]], now: str
) -> list[dict[str, str]]:
    """New conditions with lastTransitionTime carried over where the status did not change."""
    previous = {c.get("type"): c for c in old or ()}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        unchanged = before is not None and before.get("status") == cond["status"]
        stamp = before.get("lastTransitionTime", now) if unchanged and before else now
        merged.append({**cond, "lastTransitionTime": stamp})
    return merged


def conditions_equal(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    def strip(conds: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in conds or ()]

    return strip(a) == strip(b)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def status_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of `new` that say something `old` does not (a null and a missing key say the same; conditions
    compare without lastTransitionTime): the status patch of a pass, empty when nothing moved."""
    changed = {k: v for k, v in new.items() if k != "conditions" and _without_nulls(old.get(k)) != _without_nulls(v)}
    if "conditions" in new and not conditions_equal(old.get("conditions") or [], new["conditions"]):
        changed["conditions"] = new["conditions"]
    return changed


def pool_statuses(plan: Plan, states: Mapping[str, ChildState],
                  measurements: Mapping[str, PoolMeasurement] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One entry per usable pool: its profile (or why none), its replicas, and with spec.placement.profiling in
    effect the figures it runs on (`measurements`: where each measured pool stands, profile_sync.py)."""
    entries = []
    for choice in plan.choices:
        pool, profile = choice.pool, choice.profile
        entry: dict[str, Any] = {
            "name": pool.name,
            "device": pool.device,
            "nodes": pool.num_nodes,
            "reason": choice.reason,
        }
        if pool.gpu_product:
            entry.update(accelerator=pool.gpu_product, gpuMemoryMiB=pool.gpu_memory_mib)
        if profile is not None:
            entry.update(
                profile=profile.label(),
                dtype=profile.dtype,
                quantization=profile.quantization,
                gpusPerReplica=profile.num_gpus * profile.num_nodes,
                nodesPerReplica=profile.num_nodes,
                kvCacheBytes=profile.kv_cache_bytes,
                capacity=choice.capacity,
            )
        if pool.name in plan.replicas_by_pool:
            deployment = deployment_name(plan.owner.name, pool.name)
            state = states.get(deployment)
            entry.update(
                deployment=deployment,
                replicas=plan.replicas_by_pool[pool.name],
                readyReplicas=state.ready_replicas if state else 0,
            )
        elif profile is not None:
            entry["reason"] = f"not allowed by spec.placement.allowedPools; {choice.reason}"
        if pool.name in plan.figures:
            entry["performance"] = performance_status(plan.figures[pool.name], (measurements or {}).get(pool.name))
        entries.append(entry)
    return entries


def profile_summary(plan: Plan) -> str:
    """Short text for `kubectl get infdep`: replicas x profile per serving pool."""
    parts = []
    for pool_name, replicas in plan.replicas_by_pool.items():
        profile = plan.choice(pool_name).profile
        if replicas and profile is not None:
            parts.append(f"{replicas}x{profile.label()}")
    return " ".join(parts) or "-"


def build_status(
    plan: Plan,
    states: Mapping[str, ChildState],
    generation: int,
    old_status: Mapping[str, Any],
    now: str,
    cache: tuple[Mapping[str, Any], Mapping[str, str]] | None = None,
    measurements: Mapping[str, PoolMeasurement] | None = None,
    profiled: Mapping[str, str] | None = None,
    missing: Sequence[str] = (),
) -> dict[str, Any]:
    """Status after a successful apply (or a resync) of `plan`; `cache`: status.modelCache and ModelCached;
    `measurements` and `profiled`: the pools' measurements and the PoolsProfiled condition (profile_sync.py);
    `missing`: the LeaderWorkerSets the cluster could not take (no LWS API)."""
    desired = plan.desired_replicas
    wanted = [d["metadata"]["name"] for d in plan.deployments]
    present = [states[name] for name in wanted if name in states]
    ready = sum(s.ready_replicas for s in present)
    current = sum(s.replicas for s in present)
    # Pods the autoscaler put to sleep (scaleToZero.sleepLevel) are not ready by design, as pods scaled to zero
    # are absent by design: neither is a rollout in progress.
    asleep = sleep_from_status(old_status.get("autoscaling"))
    num_asleep = len(asleep.pods) if asleep else 0
    not_ready = (ready + num_asleep < desired) if num_asleep else any(
        s.ready_replicas < s.desired_replicas for s in present)  # fmt: skip
    rolling = len(present) < len(wanted) or not_ready or any(
        not s.rolled_out or s.updated_replicas < s.desired_replicas for s in present
    )
    if desired == 0:
        ready_cond = condition(READY, True, "ScaledToZero", "no replica is wanted")
    elif asleep and ready + num_asleep >= desired and ready < desired:
        ready_cond = condition(READY, True, "Sleeping", f"{num_asleep} replica(s) asleep at level {asleep.level} "
                               "(scaleToZero.sleepLevel): the first queued request wakes them")  # fmt: skip
    elif ready >= desired:
        ready_cond = condition(READY, True, "AllReplicasReady", f"{ready}/{desired} replicas ready")
    else:
        ready_cond = condition(READY, False, "ReplicasNotReady", f"{ready}/{desired} replicas ready")
    if plan.waiting_for_cache and desired:
        ready_cond = condition(READY, False, "WaitingForModelCache", "no runtime pod starts before the model is cached")
    if plan.waiting_for_cache:
        progressing = condition(PROGRESSING, True, "CachingModel", "the model cache Job fills the claim first")
    elif rolling:
        progressing = condition(
            PROGRESSING,
            True,
            "RollingOut",
            f"{len(present)}/{len(wanted)} Deployments present, {ready}/{desired} replicas ready",
        )
    else:
        progressing = condition(PROGRESSING, False, "RolloutComplete", "every Deployment is rolled out")
    unused = [c.pool.name for c in plan.choices if c.profile is None]
    if missing:
        degraded = condition(
            DEGRADED, True, "LeaderWorkerSetNotInstalled",
            f"{', '.join(missing)} run replicas that span nodes as LeaderWorkerSets (leaderworkerset.x-k8s.io/v1), "
            "which this cluster does not serve: install LWS (https://lws.sigs.k8s.io) or set "
            "spec.placement.maxNodesPerReplica to 1; the other pools serve",
        )  # fmt: skip
    elif plan.num_unplaced:
        degraded = condition(
            DEGRADED, True, "InsufficientCapacity",
            f"{plan.num_unplaced} replica(s) exceed the capacity of the serving pools and wait Pending",
        )  # fmt: skip
    else:
        note = f"; pools without a fitting profile: {', '.join(unused)}" if unused else ""
        degraded = condition(DEGRADED, False, "AsExpected", f"placed on {len(wanted)} pool(s){note}")
    conditions: list[Mapping[str, str]] = [ready_cond, progressing, degraded]
    extra: dict[str, Any] = {}
    if cache is not None:
        extra["modelCache"] = dict(cache[0])
        conditions.append(cache[1])
    if plan.spec.optimized:
        conditions.append(slo_condition(old_status))
    if profiled is not None:
        conditions.append(profiled)
    if plan.shape is not None:
        extra["modelParameters"] = {"total": plan.shape.num_parameters, "active": active_parameters(plan.shape)}
    return {
        **extra,
        "observedGeneration": generation,
        "replicas": current,
        "readyReplicas": ready,
        "selector": plan.selector,
        "model": served_model_name(plan.owner.name, plan.spec),
        "profile": profile_summary(plan),
        "pools": pool_statuses(plan, states, measurements),
        "appliedHash": plan.fingerprint,
        "conditions": merge_conditions(old_status.get("conditions") or [], conditions, now),
    }


def failed_status(
    generation: int, old_status: Mapping[str, Any], now: str, reason: str, message: str
) -> dict[str, Any]:
    """Status when the spec cannot be served: Degraded with the reason; Ready and replicas untouched."""
    old_conditions = old_status.get("conditions") or []
    kept = [c for c in old_conditions if c.get("type") in (READY,)]
    if not kept:
        kept = [condition(READY, False, reason, message)]
    new = [
        *({k: v for k, v in c.items() if k != "lastTransitionTime"} for c in kept),
        condition(PROGRESSING, False, reason, message),
        condition(DEGRADED, True, reason, message),
    ]
    return {"observedGeneration": generation, "conditions": merge_conditions(old_conditions, new, now)}
