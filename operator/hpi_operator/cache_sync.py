"""Driving the shared model cache on the cluster (the I/O half of cache.py), once per reconcile.

- `sync_cache`, before the Deployments are applied: the claim (when the operator owns it) and the fill Job
  for the wanted revision (created, or replaced with the next attempt once the backoff after a failure has
  passed); fill Jobs of revisions no longer wanted are deleted. It says which revision pods run from: the
  wanted one once its Job completed, else the one they ran from before (or none: no pods yet).
- `collect_old_revision`, after the Deployments were applied: when pods moved to a new revision and the
  rollout finished (no pod of the old one left), a Job deletes the old revision's directory; only on a claim
  the operator created, since other workloads may read revisions on a claim they share.
Everything it remembers is on the cluster: the attempt on the Job, the paths in status.modelCache.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .cache import (
    ANNOTATION_ATTEMPT,
    COMPLETE,
    FAILED,
    LABEL_CACHE_JOB,
    RUNNING,
    JobState,
    build_remove_job,
    progress,
    retry_delay_s,
)
from .children import apply_object
from .kube import KubeClient, collection_path, with_query
from .manifests import label_selector, stamp_hash
from .names import LABEL_COMPONENT
from .plan import Plan
from .status import ChildState, condition

MODEL_CACHED = "ModelCached"


def _parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _format_time(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class CacheReport:
    """The cache as this reconcile found and left it."""

    job: JobState
    served_path: str | None  # the complete revision pods run from
    previous_path: str | None  # a revision pods ran from before, to remove once unused
    next_attempt_at: str | None = None  # after a failure: when the next attempt starts
    last_failure: str | None = None  # the latest failed attempt and why (kept in status until one succeeds)


def _owned_jobs(kube: KubeClient, plan: Plan, owner_uid: str | None) -> list[dict[str, Any]]:
    selector = label_selector(plan.owner.name, **{LABEL_COMPONENT: "model-cache"})
    listing = kube.request("GET", with_query(collection_path("Job", plan.owner.namespace), labelSelector=selector))
    return [
        item for item in listing.get("items") or []
        if owner_uid is None or any(r.get("uid") == owner_uid for r in item["metadata"].get("ownerReferences") or [])
    ]  # fmt: skip


def _delete_job(kube: KubeClient, namespace: str, name: str) -> None:
    # Background: the Job goes now, its pods after it (the garbage collector).
    kube.request("DELETE", f"{collection_path('Job', namespace)}/{name}", {"propagationPolicy": "Background"})


def _next_attempt(job: Mapping[str, Any], attempt: int) -> dict[str, Any]:
    body = {**job, "metadata": {**job["metadata"], "annotations": {**job["metadata"]["annotations"]}}}
    body["metadata"]["annotations"][ANNOTATION_ATTEMPT] = str(attempt)
    return stamp_hash(body)


def sync_cache(
    kube: KubeClient,
    plan: Plan,
    owner_uid: str | None,
    old_cache_status: Mapping[str, Any],
    now: str,
    retry_base_s: float,
) -> CacheReport:
    """Claim and fill Job for `plan.cache` (not None); see the module docstring."""
    cache = plan.cache
    assert cache is not None
    namespace = plan.owner.namespace
    if cache.pvc is not None:
        apply_object(kube, cache.pvc)
    wanted = cache.fill_job["metadata"]["name"]
    for job in _owned_jobs(kube, plan, owner_uid):
        name, labels = job["metadata"]["name"], job["metadata"].get("labels") or {}
        if labels.get(LABEL_CACHE_JOB) == "fill" and name != wanted:
            _delete_job(kube, namespace, name)  # a revision (or image) no longer wanted
    next_attempt_at = None
    last_failure = old_cache_status.get("lastFailure")
    live = kube.get(f"{collection_path('Job', namespace)}/{wanted}")
    if live is None:
        live = kube.request("POST", collection_path("Job", namespace), cache.fill_job)
    state = JobState.from_job(live)
    if state.phase == FAILED:
        last_failure = f"Job {state.name} attempt {state.attempt} failed: {state.message or 'the download pod failed'}"
        failed_at = _parse_time(state.finished_at) or _parse_time(now)
        assert failed_at is not None
        retry_at = failed_at + datetime.timedelta(seconds=retry_delay_s(state.attempt, retry_base_s))
        if _parse_time(now) >= retry_at:  # type: ignore[operator]
            _delete_job(kube, namespace, wanted)
            retry = _next_attempt(cache.fill_job, state.attempt + 1)
            live = kube.request("POST", collection_path("Job", namespace), retry)
            state = JobState.from_job(live)
        else:
            next_attempt_at = _format_time(retry_at)
    elif state.phase == COMPLETE:
        last_failure = None
    old_served = old_cache_status.get("servedPath")
    served = cache.path if state.phase == COMPLETE else old_served
    previous = old_cache_status.get("previousPath")
    if old_served and served != old_served:
        previous = old_served
    if previous == served:
        previous = None
    return CacheReport(state, served, previous, next_attempt_at, last_failure)


def _rolled_out(plan: Plan, states: Mapping[str, ChildState]) -> bool:
    """Every Deployment runs the planned template only: no pod of an earlier one is left."""
    wanted = [d["metadata"]["name"] for d in plan.deployments]
    return all(
        name in states
        and states[name].rolled_out
        and states[name].replicas == states[name].updated_replicas == states[name].desired_replicas
        for name in wanted
    )


def collect_old_revision(
    kube: KubeClient, plan: Plan, states: Mapping[str, ChildState], report: CacheReport
) -> CacheReport:
    """Remove `report.previous_path` once no pod uses it; returns the report with it cleared when removed."""
    cache = plan.cache
    if cache is None or not report.previous_path or not cache.owns_claim or not _rolled_out(plan, states):
        return report
    job = build_remove_job(plan.owner, plan.spec, cache.claim_name, report.previous_path)
    job["metadata"]["ownerReferences"] = cache.fill_job["metadata"].get("ownerReferences") or []
    path = f"{collection_path('Job', plan.owner.namespace)}/{job['metadata']['name']}"
    live = kube.get(path) or kube.request("POST", collection_path("Job", plan.owner.namespace), stamp_hash(job))
    if JobState.from_job(live).phase != COMPLETE:
        return report
    _delete_job(kube, plan.owner.namespace, job["metadata"]["name"])
    return CacheReport(report.job, report.served_path, None, report.next_attempt_at, report.last_failure)


def cache_status(plan: Plan, report: CacheReport) -> tuple[dict[str, Any], dict[str, str]]:
    """status.modelCache and the ModelCached condition."""
    cache, state = plan.cache, report.job
    assert cache is not None
    model = f"{plan.spec.model.hf_id}@{plan.spec.model.hf_revision}"
    entry: dict[str, Any] = {
        "claimName": cache.claim_name,
        "revision": plan.spec.model.hf_revision,
        "path": cache.path,
        "job": state.name,
        "attempt": state.attempt,
        "phase": state.phase,
        "progress": progress(state),
    }
    if report.served_path:
        entry["servedPath"] = report.served_path
    # Explicit nulls: status is written as a merge patch, where a missing key would keep its old value.
    entry["previousPath"] = report.previous_path
    entry["nextAttemptAt"] = report.next_attempt_at
    entry["lastFailure"] = report.last_failure
    if state.phase == COMPLETE:
        cond = condition(MODEL_CACHED, True, "Cached", f"{model} is complete on claim {cache.claim_name}")
    elif state.phase == FAILED:
        cond = condition(MODEL_CACHED, False, "DownloadFailed",
                         f"{model}: {report.last_failure}; attempt {state.attempt + 1} starts at "
                         f"{report.next_attempt_at}")  # fmt: skip
    else:
        reason = "Downloading" if state.phase == RUNNING else "DownloadPending"
        serving = f"; pods keep serving {report.served_path} meanwhile" if report.served_path else ""
        failed = f"; after {report.last_failure}" if report.last_failure else ""
        cond = condition(MODEL_CACHED, False, reason, f"{model}: {progress(state)}{serving}{failed}")
    return entry, cond
