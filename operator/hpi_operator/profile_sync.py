"""Measuring pools on the cluster (the I/O half of profiling.py), once per reconcile, before the children are
applied: for each pool of `plan.profile_targets`,

- its key's cache ConfigMap holds figures: they are the pool's, and a profiling Job left for it goes;
- else its profiling Job is created; once it completed, the figures are read from its pod's termination message
  (the operator needs no access to logs), written to the cache and the Job is deleted;
- a Job that failed, or completed with a message that does not parse, is replaced by the next attempt after a
  backoff (doubling, capped, as the model cache's), and said in status and an Event meanwhile.
Profiling Jobs of pools or keys no longer wanted are deleted. Nothing here blocks serving: the pool's pods run
meanwhile on the figures they have (assumed, or none). What it remembers is on the cluster: the attempt on the
Job, the failure in status.pools[].performance.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from hpi_contracts.pool_profile import PoolProfile

from .cache import COMPLETE, FAILED, JobState, retry_delay_s
from .children import apply_object
from .kube import KubeClient, KubeError, collection_path, object_path, with_query
from .manifests import label_selector
from .names import LABEL_COMPONENT
from .plan import Plan
from .profiling import (
    ANNOTATION_ATTEMPT,
    COMPONENT,
    CachedProfile,
    PoolMeasurement,
    ProfileTarget,
    build_cache_configmap,
    cache_configmap_name,
    model_identity,
    next_attempt,
    profile_from_message,
    read_cache_configmap,
    termination_message,
)
from .status import condition

POOLS_PROFILED = "PoolsProfiled"
UNREADABLE = "left no readable profile"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # set by the Job controller on its pods (Kubernetes >= 1.27)


def _parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _delete_job(kube: KubeClient, namespace: str, name: str) -> None:
    kube.request("DELETE", object_path("Job", namespace, name), {"propagationPolicy": "Background"})


def _old_field(old_status: Mapping[str, Any], field: str) -> dict[str, str]:
    """pool -> status.pools[].performance.<field>, where set."""
    found = {}
    for entry in old_status.get("pools") or []:
        value = ((entry or {}).get("performance") or {}).get(field)
        if value:
            found[entry["name"]] = value
    return found


def _job_result(kube: KubeClient, namespace: str, job_name: str) -> PoolProfile:
    """The figures a completed Job's pod left in its termination message; ValueError saying why there are none."""
    path = with_query(collection_path("Pod", namespace), labelSelector=f"{JOB_NAME_LABEL}={job_name}")
    messages = [termination_message(pod) for pod in kube.request("GET", path).get("items") or []]
    finished = [m for m in messages if m]
    return profile_from_message(finished[-1] if finished else None)


def failure_reason(last_failure: str) -> str:
    """The condition's and the Event's reason for a failed measurement."""
    return "UnreadableProfile" if UNREADABLE in last_failure else "ProfilingFailed"


def _measure(kube: KubeClient, plan: Plan, target: ProfileTarget, old_failure: str | None, now: str,
             retry_base_s: float) -> PoolMeasurement:  # fmt: skip
    namespace = plan.owner.namespace
    cached_cm = kube.get(object_path("ConfigMap", namespace, cache_configmap_name(target.key)))
    name = target.job["metadata"]["name"]
    job_path = object_path("Job", namespace, name)
    if cached_cm is not None:
        try:
            cached = read_cache_configmap(cached_cm)
        except ValueError:
            cached = None  # a broken entry: measured again, and overwritten
        if cached is not None:
            if kube.get(job_path) is not None:
                _delete_job(kube, namespace, name)
            return PoolMeasurement(target.pool, target.key, target.node_kind, cached.profile, cached.measured_at)
    live = kube.get(job_path) or kube.request("POST", collection_path("Job", namespace), target.job)
    state = JobState.from_job(live, ANNOTATION_ATTEMPT)
    failure = None
    if state.phase == COMPLETE:
        try:
            result = _job_result(kube, namespace, name)
        except ValueError as e:
            failure = f"Job {name} attempt {state.attempt} completed but {UNREADABLE}: {e}"
        else:
            cached = CachedProfile(result, now, target.node_kind)
            apply_object(kube, build_cache_configmap(namespace, target.key, cached, model_identity(plan.spec)))
            _delete_job(kube, namespace, name)
            return PoolMeasurement(target.pool, target.key, target.node_kind, cached.profile, now)
    elif state.phase == FAILED:
        failure = f"Job {name} attempt {state.attempt} failed: {state.message or 'the profiling pod failed'}"
    next_attempt_at = None
    if failure is not None:
        retry_at = _parse_time(state.finished_at or now) + datetime.timedelta(
            seconds=retry_delay_s(state.attempt, retry_base_s))
        if _parse_time(now) >= retry_at:
            _delete_job(kube, namespace, name)
            live = kube.request("POST", collection_path("Job", namespace), next_attempt(target.job, state.attempt + 1))
            state = JobState.from_job(live, ANNOTATION_ATTEMPT)
        else:
            next_attempt_at = _format_time(retry_at)
    return PoolMeasurement(target.pool, target.key, target.node_kind, job=name, attempt=state.attempt,
                           last_failure=failure or old_failure, next_attempt_at=next_attempt_at)  # fmt: skip


def sync_profiles(kube: KubeClient, plan: Plan, owner_uid: str | None, old_status: Mapping[str, Any], now: str,
                  retry_base_s: float) -> dict[str, PoolMeasurement]:  # fmt: skip
    """Measure the pools of `plan.profile_targets` (see the module docstring); pool -> where it stands."""
    namespace = plan.owner.namespace
    old_failures = _old_field(old_status, "lastFailure")
    found = {t.pool: _measure(kube, plan, t, old_failures.get(t.pool), now, retry_base_s)
             for t in plan.profile_targets}  # fmt: skip
    running = {m.job for m in found.values() if m.job}
    if not plan.spec.profiled and not _old_field(old_status, "job"):
        # Profiling is off and status names no Job of ours: nothing to delete, and no list call on every pass of
        # every resource. (A Job created just before a crash that kept status from naming it, and then unwanted,
        # is bounded by its deadline and goes with the resource.)
        return found
    selector = label_selector(plan.owner.name, **{LABEL_COMPONENT: COMPONENT})
    try:
        listing = kube.request("GET", with_query(collection_path("Job", namespace), labelSelector=selector))
    except KubeError as e:
        if e.status != 404:
            raise
        listing = {}
    for job in listing.get("items") or []:
        meta = job.get("metadata") or {}
        owned = owner_uid is None or any(r.get("uid") == owner_uid for r in meta.get("ownerReferences") or [])
        if owned and meta.get("name") not in running:
            _delete_job(kube, namespace, meta["name"])  # a pool, engine setting or node kind no longer wanted
    return found


def profiled_condition(plan: Plan, found: Mapping[str, PoolMeasurement]) -> dict[str, str]:
    """PoolsProfiled: whether every pool without an override runs on measured figures, and if not, why."""
    failed = [m for m in found.values() if m.profile is None and m.last_failure]
    if failed:
        reason = "UnreadableProfile" if any(UNREADABLE in (m.last_failure or "") for m in failed) else (
            "ProfilingFailed")
        parts = [f"{m.pool}: {m.last_failure}" + (f"; next attempt at {m.next_attempt_at}" if m.next_attempt_at
                                                  else f"; attempt {m.attempt} runs") for m in failed]  # fmt: skip
        return condition(POOLS_PROFILED, False, reason, "; ".join(parts) + "; the pools serve meanwhile")
    waiting = [m for m in found.values() if m.profile is None]
    if waiting:
        parts = [f"{m.pool}: Job {m.job} (attempt {m.attempt}), serving meanwhile {_meanwhile(plan, m.pool)}"
                 for m in waiting]  # fmt: skip
        return condition(POOLS_PROFILED, False, "Measuring", "; ".join(parts))
    if not found:
        return condition(POOLS_PROFILED, True, "NothingToMeasure", "every serving pool's performance is in the spec")
    parts = [f"{m.pool} on {m.node_kind} at {m.measured_at}" for m in found.values()]
    return condition(POOLS_PROFILED, True, "Measured", "measured: " + "; ".join(parts))


def _meanwhile(plan: Plan, pool: str) -> str:
    figures = plan.figures.get(pool)
    return f"on {figures.source} figures" if figures else "without figures"


def profile_events(old_status: Mapping[str, Any], found: Mapping[str, PoolMeasurement]) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events this pass owes: a new failure, a pool newly measured."""
    old = {e.get("name"): (e.get("performance") or {}) for e in old_status.get("pools") or [] if isinstance(e, Mapping)}
    events = []
    for m in found.values():
        before = old.get(m.pool) or {}
        if m.profile is None and m.last_failure and m.last_failure != before.get("lastFailure"):
            events.append(("Warning", failure_reason(m.last_failure), f"pool {m.pool}: {m.last_failure}"))
        if m.profile is not None and (before.get("source") != "measured" or before.get("cacheKey") != m.key):
            events.append(("Normal", "PoolProfiled", f"pool {m.pool} measured on {m.node_kind}: ITL "
                           f"{m.profile.itl_alpha_ms:.2f} + {m.profile.itl_beta_ms:.3f} x batch ms, prefill "
                           f"{m.profile.prefill_tokens_per_s:.0f} tokens/s, {m.profile.max_num_seqs} sequences"))
    return events
