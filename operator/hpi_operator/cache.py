"""The shared model cache (spec.model.cache), as pure functions: the claim, the Job that fills it, the Job that
removes an old revision, and what a Job's state means for the InferenceDeployment.

Layout on the volume: `models/<org>/<name>/<revision>/`, one directory per revision, filled by the runtime's
downloader (runtime/hpi_runtime/download.py: only the shards the loader reads, verified, resumable, a
completion marker written last; `compile-cache/` beside it, the runtime's writable compile cache, manifests.py).
Runtime pods mount the models read-only and an init container refuses a
directory without the marker. A revision change downloads beside the revision that is serving; the pods move
over only when the new directory is complete, and the old one is removed once no pod uses it.

Retries: the Job controller retries the download pod with its own exponential backoff (`JOB_BACKOFF_LIMIT`);
when the Job has failed, the operator replaces it after `retry_delay_s(attempt)` (doubling, capped). The
attempt count lives on the Job (an annotation), the failure time in its status: nothing in operator memory.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .manifests import (
    CACHE_VOLUME_MOUNT,
    Owner,
    cache_claim_name,
    cache_model_dir,
    common_labels,
    container_security_context,
    pod_security_context,
    short_name,
    stamp_hash,
)
from .names import GROUP, LABEL_COMPONENT
from .sizing import GIB, ModelShape
from .spec import InferenceSpec

COMPONENT = "model-cache"
ANNOTATION_ATTEMPT = f"{GROUP}/cache-attempt"
LABEL_CACHE_JOB = f"{GROUP}/cache-job"  # fill | remove | adapter (adapters.py)
JOB_BACKOFF_LIMIT = 3  # pod retries inside one Job (the Job controller waits 10 s, 20 s, 40 s between them)
JOB_DEADLINE_S = 6 * 3600  # a download that hangs this long is a failure, retried like one
RETRY_BASE_DELAY_S = 60.0
RETRY_MAX_DELAY_S = 3600.0
CHECKPOINT_BYTES_PER_PARAMETER = 2  # Hub checkpoints of the models served here are bf16/fp16
SIZE_HEADROOM = 1.10  # filesystem overhead, tokenizer and config files
MIN_SIZE_GIB = 1

PENDING, RUNNING, COMPLETE, FAILED = "Pending", "Running", "Complete", "Failed"


def cache_size_gib(shape: ModelShape) -> int:
    """A claim that holds two revisions of the checkpoint: the serving one and the next while it downloads."""
    checkpoint = shape.num_parameters * CHECKPOINT_BYTES_PER_PARAMETER
    return max(MIN_SIZE_GIB, math.ceil(2 * checkpoint * SIZE_HEADROOM / GIB))


def _labels(owner: Owner) -> dict[str, str]:
    return {**common_labels(owner.name), LABEL_COMPONENT: COMPONENT}


def build_cache_pvc(owner: Owner, spec: InferenceSpec, shape: ModelShape) -> dict[str, Any]:
    """The claim the operator creates when spec.model.cache names none (owned: it goes with the resource)."""
    cache = spec.model.cache
    size = cache.size or f"{cache_size_gib(shape)}Gi"
    pvc_spec: dict[str, Any] = {"accessModes": [cache.access_mode], "resources": {"requests": {"storage": size}}}
    if cache.storage_class:
        pvc_spec["storageClassName"] = cache.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": cache_claim_name(owner.name, spec),
            "namespace": owner.namespace,
            "labels": _labels(owner),
            "annotations": {},
        },  # fmt: skip
        "spec": pvc_spec,
    }


def _pod_template(owner: Owner, spec: InferenceSpec, claim: str, args: list[str]) -> dict[str, Any]:
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": "/tmp/huggingface"}]
    token = spec.model.hf_token_secret
    if token:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    container = {
        "name": "download",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["python", "-m", "hpi_runtime.download"],
        "args": args,
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_VOLUME_MOUNT}],
        # The downloader's JSON summary (commit, bytes, or the error) becomes the pod's termination message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(),
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # each retry is a new pod, so the Job controller's backoff applies
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "persistentVolumeClaim": {"claimName": claim}}],
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
    }
    if spec.runtime.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.runtime.image_pull_secrets]
    return {"metadata": {"labels": _labels(owner)}, "spec": pod_spec}


JOB_KINDS = {"cache": "fill", "cache-gc": "remove", "adapter": "adapter"}  # name part -> LABEL_CACHE_JOB value


def _job(owner: Owner, kind: str, template: dict[str, Any], attempt: int) -> dict[str, Any]:
    job_spec = {
        "backoffLimit": JOB_BACKOFF_LIMIT,
        "activeDeadlineSeconds": JOB_DEADLINE_S,
        "template": template,
    }
    # Job templates are immutable: a different download is a different Job, named by what it does.
    digest = hashlib.sha256(json.dumps(job_spec, sort_keys=True).encode()).hexdigest()[:8]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": short_name(f"{owner.name}-{kind}-{digest}"),
            "namespace": owner.namespace,
            "labels": {**_labels(owner), LABEL_CACHE_JOB: JOB_KINDS[kind]},
            "annotations": {ANNOTATION_ATTEMPT: str(attempt)},
        },
        "spec": job_spec,
    }
    return stamp_hash(job)


def build_fill_job(owner: Owner, spec: InferenceSpec, claim: str, attempt: int = 1) -> dict[str, Any]:
    """The Job that downloads the wanted revision into its directory on the claim."""
    args = ["fetch", spec.model.hf_id or "", cache_model_dir(spec), "--revision", spec.model.hf_revision,
            "--termination-log", "/dev/termination-log"]  # fmt: skip
    return _job(owner, "cache", _pod_template(owner, spec, claim, args), attempt)


def build_adapter_job(owner: Owner, spec: InferenceSpec, claim: str, hf_id: str, revision: str, path: str,
                      attempt: int = 1) -> dict[str, Any]:  # fmt: skip
    """The Job that downloads a LoRA adapter (adapters.py) into its directory on the claim."""
    args = ["fetch", hf_id, path, "--revision", revision, "--adapter", "--termination-log", "/dev/termination-log"]
    return _job(owner, "adapter", _pod_template(owner, spec, claim, args), attempt)


def build_remove_job(owner: Owner, spec: InferenceSpec, claim: str, path: str) -> dict[str, Any]:
    """The Job that deletes a revision directory no pod uses any more."""
    return _job(owner, "cache-gc", _pod_template(owner, spec, claim, ["remove", path]), 1)


@dataclass(frozen=True)
class CachePlan:
    """The cache children of one InferenceDeployment and where the wanted revision lands."""

    claim_name: str
    owns_claim: bool  # the operator created the claim (so no one else's revisions live on it)
    pvc: dict[str, Any] | None
    fill_job: dict[str, Any]
    path: str  # the wanted revision's directory, as pods see it


def plan_cache(owner: Owner, spec: InferenceSpec, shape: ModelShape) -> CachePlan | None:
    """The claim and fill Job for a persistentVolumeClaim cache; None without one (hostPath needs neither)."""
    cache = spec.model.cache
    if not cache.enabled or cache.volume != "persistentVolumeClaim" or spec.model.source != "huggingface":
        return None
    claim = cache_claim_name(owner.name, spec)
    pvc = None if cache.claim_name else stamp_hash(build_cache_pvc(owner, spec, shape))
    return CachePlan(claim, pvc is not None, pvc, build_fill_job(owner, spec, claim), cache_model_dir(spec))


@dataclass(frozen=True)
class JobState:
    """What the operator needs from one of its Jobs (a cache Job's, or a profiling Job's: profiling.py)."""

    name: str
    phase: str  # Pending | Running | Complete | Failed
    attempt: int
    num_failed_pods: int
    finished_at: str | None  # when it completed or failed (RFC 3339)
    message: str  # why it failed, from the Job's Failed condition

    @classmethod
    def from_job(cls, obj: Mapping[str, Any], attempt_annotation: str = ANNOTATION_ATTEMPT) -> JobState:
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
        if "Complete" in conditions or (status.get("succeeded") or 0) > 0:
            phase, cond = COMPLETE, conditions.get("Complete", {})
        elif "Failed" in conditions:
            phase, cond = FAILED, conditions["Failed"]
        else:
            phase, cond = (RUNNING if (status.get("active") or 0) > 0 else PENDING), {}
        return cls(
            name=meta.get("name", ""),
            phase=phase,
            attempt=int((meta.get("annotations") or {}).get(attempt_annotation) or 1),
            num_failed_pods=int(status.get("failed") or 0),
            finished_at=cond.get("lastTransitionTime") or status.get("completionTime"),
            message=" ".join(filter(None, (cond.get("reason"), cond.get("message")))) or "",
        )


def retry_delay_s(attempt: int, base_s: float = RETRY_BASE_DELAY_S) -> float:
    """How long after attempt `attempt` failed the next one starts: doubling, capped at an hour."""
    return min(base_s * 2 ** max(attempt - 1, 0), RETRY_MAX_DELAY_S)


def progress(state: JobState) -> str:
    """One line for status.modelCache.progress."""
    failures = f", {state.num_failed_pods} pod(s) failed and retried" if state.num_failed_pods else ""
    if state.phase == COMPLETE:
        return f"complete (Job {state.name}, attempt {state.attempt})"
    if state.phase == FAILED:
        return f"failed (Job {state.name}, attempt {state.attempt}{failures})"
    verb = "downloading" if state.phase == RUNNING else "waiting for the download pod"
    return f"{verb} (Job {state.name}, attempt {state.attempt}{failures})"
