"""Pools measured on the cluster, as pure functions (profile_sync.py does the I/O): what to measure, the Job that
measures, the cache of results, the figures each pool runs on and how they reach its pods.

- Which pools: with spec.placement.profiling in effect (auto: autoscaling mode optimizer, whose figures they are;
  always; never), every serving pool whose performance spec.placement.pools[] does not give.
- The Job: the pool's own pod (image, engine flags, model volume, resources, nodeSelector, affinity, tolerations)
  running `hpi profile --compact` instead of `hpi serve`, so it lands on the pool's kind of node and loads the
  model exactly as the pods do. Short (a few batch sizes, a few steps) and bounded (activeDeadlineSeconds,
  backoffLimit). Its JSON goes to /dev/termination-log, which the kubelet copies into the pod's status: the
  operator reads pods, never their logs.
- The cache: one ConfigMap per key, `hpi-pool-profile-<key>`, the key a hash of what the figures depend on (the
  model and its revision, the engine settings, the node kind). Not owned by any InferenceDeployment: a restarted
  operator and every InferenceDeployment of the same model on the same node kind in the namespace reuse it;
  deleting it measures again (after a runtime upgrade, say: the image is not part of the key).
- The figures a pool runs on (the optimizer's and the router's): spec override > measured (cache) > assumed
  (published GPU figures, fleet/assumed.py) > none.
- Delivery: per pool a ConfigMap `<name>-<pool>-profile` holding those figures as `--pool-profile` JSON, mounted
  into the pool's pods, which re-read it when it changes (runtime/hpi_runtime/server/profile_file.py): the
  figures move from assumed to measured without a rollout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hpi_contracts.pool_profile import PoolProfile, pool_profile_flag, profile_from_json

from .fleet.assumed import assumed_performance
from .manifests import Owner, build_deployment, common_labels, engine_args, short_name, stamp_hash
from .names import (
    GROUP,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_POOL,
    OPERATOR_NAME,
    RUNTIME_NAME,
)
from .nodes import Pool
from .profiles import PoolChoice, Profile
from .sizing import ModelShape
from .spec import InferenceSpec

COMPONENT = "pool-profile"
CACHE_COMPONENT = "pool-profile-cache"
LABEL_PROFILE_KEY = f"{GROUP}/profile-key"
ANNOTATION_ATTEMPT = f"{GROUP}/profile-attempt"
CONTAINER = "profile"
DATA_KEY = "profile.json"
CACHE_PREFIX = "hpi-pool-profile-"
# Kept short: the Job holds a replica's GPUs while it runs. A few batch sizes fit the ITL line; one prompt length
# gives the prefill rate; maxNumSeqs is counted at CONTEXT_TOKENS per sequence.
BATCH_SIZES = (1, 4, 16, 64)
PROMPT_TOKENS = 512
CONTEXT_TOKENS = 1024
STEPS = 4
JOB_BACKOFF_LIMIT = 1  # one pod retry inside the Job; after that the operator's own backoff (retry_delay_s)
JOB_DEADLINE_S = 1800  # from the Job's start: a pod waiting for a free GPU counts too
RETRY_BASE_DELAY_S = 300.0
SOURCES = ("override", "measured", "assumed", "none")


def model_identity(spec: InferenceSpec) -> str:
    """The weights the figures belong to."""
    model = spec.model
    if model.source == "huggingface":
        return f"hf:{model.hf_id}@{model.hf_revision}"
    if model.source == "pvc":
        return f"pvc:{model.pvc_claim_name}/{model.pvc_path or ''}"
    return "embedded"


def node_kind(pool: Pool) -> str:
    """The labels that make nodes the same for speed: the GPU product and memory, or the CPU's arch and bf16 ISA;
    and the cloud's instance type where the pool's nodes share one (core count and memory bandwidth differ)."""
    if pool.device == "cuda":
        kind = f"gpu {pool.gpu_product} {pool.gpu_memory_mib}MiB"
    else:
        isa = "amx" if pool.cpu_amx else "avx512bf16" if pool.cpu_bf16 else "no-bf16"
        kind = f"cpu {pool.arch} {isa}"
    return f"{kind} {pool.instance_type}" if pool.instance_type else kind


def cache_key(spec: InferenceSpec, profile: Profile, pool: Pool) -> str:
    """What the figures depend on, hashed: the model, the engine settings the pods run with, the node kind."""
    engine = spec.engine
    identity = {
        "model": model_identity(spec),
        "engine": {"device": profile.device, "dtype": profile.dtype, "quantization": profile.quantization,
                   "tensorParallel": max(profile.num_gpus, 1), "kvCacheBytesPerGpu": profile.kv_cache_bytes_per_gpu,
                   "maxModelLen": engine.max_model_len, "maxNumSeqs": engine.max_num_seqs,
                   "maxNumBatchedTokens": engine.max_num_batched_tokens, "blockSize": engine.block_size,
                   # Only when set: the keys of profiles measured before the field existed stay valid.
                   **({"kvCacheDtype": engine.kv_cache_dtype} if engine.kv_cache_dtype != "auto" else {})},
        "node": node_kind(pool),
        # How it was measured: decode steps at CONTEXT_TOKENS of context. Figures cached before `hpi profile` timed
        # decode at the serving context (it used 26 tokens, which left the KV reads out of beta) have other keys,
        # so an upgraded operator measures every pool again instead of trusting them.
        "method": {"decodeContextTokens": CONTEXT_TOKENS},
    }  # fmt: skip
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def cache_configmap_name(key: str) -> str:
    return f"{CACHE_PREFIX}{key}"


def pool_configmap_name(owner_name: str, pool_name: str) -> str:
    return short_name(f"{owner_name}-{pool_name}-profile")


def profile_args(spec: InferenceSpec, owner_name: str, profile: Profile, cached_dir: str | None) -> list[str]:
    """`hpi profile` with the pool's engine flags and a short, bounded measurement."""
    engine = spec.engine
    batch_sizes = [b for b in BATCH_SIZES if b <= engine.max_num_seqs] or [1]
    return ["profile", *engine_args(owner_name, spec, profile, cached_dir),
            "--batch-sizes", ",".join(map(str, batch_sizes)),
            "--prompt-lengths", str(max(1, min(PROMPT_TOKENS, engine.max_model_len - 1))),
            "--context-tokens", str(min(CONTEXT_TOKENS, engine.max_model_len)), "--steps", str(STEPS),
            "--compact", "--output", "/dev/termination-log"]  # fmt: skip


def build_profile_job(
    owner: Owner, spec: InferenceSpec, pool: Pool, profile: Profile, cached_dir: str | None, attempt: int = 1
) -> dict[str, Any]:
    """The Job that measures one replica of `pool`: the pool's pod template, running `hpi profile`."""
    key = cache_key(spec, profile, pool)
    template = build_deployment(owner, spec, pool, profile, 1, cached_dir)["spec"]["template"]
    pod_spec = template["spec"]
    [container] = pod_spec["containers"]
    for field in ("ports", "startupProbe", "livenessProbe", "readinessProbe", "lifecycle"):
        container.pop(field, None)  # nothing serves: no probes, no drain
    container.update(name=CONTAINER, args=profile_args(spec, owner.name, profile, cached_dir),
                     terminationMessagePath="/dev/termination-log", terminationMessagePolicy="File")  # fmt: skip
    pod_spec.update(restartPolicy="Never", terminationGracePeriodSeconds=10)
    pod_spec.pop("topologySpreadConstraints", None)
    # Not the runtime pods' labels: the Services and the autoscaler select those, and this pod serves nothing.
    pod_labels = {LABEL_NAME: RUNTIME_NAME, LABEL_INSTANCE: short_name(owner.name), LABEL_COMPONENT: COMPONENT,
                  LABEL_MANAGED_BY: OPERATOR_NAME, LABEL_PROFILE_KEY: key}  # fmt: skip
    job_spec = {
        "backoffLimit": JOB_BACKOFF_LIMIT,
        "activeDeadlineSeconds": JOB_DEADLINE_S,
        "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": short_name(f"{owner.name}-profile-{pool.name}-{key[:8]}"),
            "namespace": owner.namespace,
            "labels": {**common_labels(owner.name), LABEL_COMPONENT: COMPONENT, LABEL_POOL: short_name(pool.name),
                       LABEL_PROFILE_KEY: key},  # fmt: skip
            "annotations": {ANNOTATION_ATTEMPT: str(attempt)},
        },
        "spec": job_spec,
    }
    return stamp_hash(job)


def next_attempt(job: Mapping[str, Any], attempt: int) -> dict[str, Any]:
    """The same Job as attempt `attempt` (a fresh object: Job templates are immutable, the failed one goes)."""
    body = json.loads(json.dumps(job))
    body["metadata"]["annotations"][ANNOTATION_ATTEMPT] = str(attempt)
    body["metadata"].pop("resourceVersion", None)
    body["metadata"].pop("uid", None)
    body.pop("status", None)
    return stamp_hash(body)


@dataclass(frozen=True)
class ProfileTarget:
    """One pool to measure: its cache key, its node kind and the Job that measures it."""

    pool: str
    key: str
    node_kind: str
    job: dict[str, Any]


@dataclass(frozen=True)
class CachedProfile:
    profile: PoolProfile
    measured_at: str
    node_kind: str


def build_cache_configmap(namespace: str, key: str, cached: CachedProfile, model: str) -> dict[str, Any]:
    """The cache entry: the figures and where and when they were measured (no owner: it outlives its writer)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": cache_configmap_name(key),
            "namespace": namespace,
            "labels": {LABEL_NAME: RUNTIME_NAME, LABEL_COMPONENT: CACHE_COMPONENT, LABEL_MANAGED_BY: OPERATOR_NAME,
                       LABEL_PROFILE_KEY: key},  # fmt: skip
            "annotations": {},
        },
        "data": {DATA_KEY: pool_profile_flag(cached.profile), "measuredAt": cached.measured_at,
                 "nodeKind": cached.node_kind, "model": model},  # fmt: skip
    }


def read_cache_configmap(configmap: Mapping[str, Any]) -> CachedProfile:
    """A cache entry -> its figures; ValueError when it holds none (hand-edited, half-written)."""
    data = configmap.get("data") or {}
    try:
        raw = json.loads(data.get(DATA_KEY) or "")
    except json.JSONDecodeError as exc:
        raise ValueError(f"ConfigMap {configmap.get('metadata', {}).get('name')}: {DATA_KEY} is not JSON") from exc
    return CachedProfile(profile_from_json(raw), str(data.get("measuredAt") or ""), str(data.get("nodeKind") or ""))


def build_pool_configmap(owner: Owner, pool_name: str, figures: PoolProfile | None,
                         slo_max_num_seqs: int | None = None) -> dict[str, Any]:  # fmt: skip
    """What the pool's pods read as `--pool-profile @file`: the figures the pool runs on, or nothing yet; with
    the fleet optimizer's planned SLO batch for the pool, which the router shares load by (policy.py)."""
    if figures is not None and slo_max_num_seqs is not None:
        figures = replace(figures, slo_max_num_seqs=slo_max_num_seqs)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": pool_configmap_name(owner.name, pool_name),
            "namespace": owner.namespace,
            "labels": {**common_labels(owner.name), LABEL_COMPONENT: COMPONENT, LABEL_POOL: short_name(pool_name)},
            "annotations": {},
        },
        "data": {DATA_KEY: pool_profile_flag(figures) if figures else ""},
    }


def termination_message(pod: Mapping[str, Any]) -> str | None:
    """The profiling container's termination message, once it has terminated."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == CONTAINER:
            terminated = (status.get("state") or {}).get("terminated") or {}
            return terminated.get("message")
    return None


def profile_from_message(message: str | None) -> PoolProfile:
    """`hpi profile --compact`'s output -> measured figures; ValueError saying what is wrong with it."""
    if not message or not message.strip():
        raise ValueError("the profiling pod left no termination message")
    try:
        raw = json.loads(message)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the termination message is not JSON ({exc.msg}): {message[:120]!r}") from None
    return profile_from_json(raw, default_source="measured")


def pool_figures(spec: InferenceSpec, choice: PoolChoice, shape: ModelShape | None,
                 measured: PoolProfile | None) -> PoolProfile | None:  # fmt: skip
    """The figures `choice`'s pool runs on: the spec's override, else the measurement, else the published GPU
    figures at CONTEXT_TOKENS (assumed), else none."""
    override = spec.placement.pool(choice.pool.name).performance
    if override is not None:
        return override.as_profile()
    if measured is not None:
        return measured
    if choice.profile is None or shape is None:
        return None
    assumed = assumed_performance(choice.pool.gpu_product, choice.profile, shape, CONTEXT_TOKENS)
    return assumed.as_profile() if assumed else None


def measured_from_status(status: Mapping[str, Any] | None, keys: Mapping[str, str]) -> dict[str, PoolProfile]:
    """The measured figures status.pools[].performance holds for the pools of `keys` (pool -> cache key): only
    where the key still matches (a changed engine setting or node kind makes them stale)."""
    found = {}
    for entry in (status or {}).get("pools") or []:
        perf = entry.get("performance") if isinstance(entry, Mapping) else None
        pool = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(perf, Mapping) or perf.get("source") != "measured" or keys.get(pool) != perf.get("cacheKey"):
            continue
        try:
            found[str(pool)] = profile_from_json(perf)
        except ValueError:
            continue  # a hand-mangled status: measured again from the cache
    return found


@dataclass(frozen=True)
class PoolMeasurement:
    """Where the measurement of one pool stands after a reconcile (profile_sync.py)."""

    pool: str
    key: str
    node_kind: str
    profile: PoolProfile | None = None  # measured (from the cache)
    measured_at: str | None = None
    job: str | None = None  # the profiling Job while one runs or waits for its retry
    attempt: int = 0
    last_failure: str | None = None  # the latest failed attempt and why (until one succeeds)
    next_attempt_at: str | None = None


def performance_status(figures: PoolProfile | None, measurement: PoolMeasurement | None) -> dict[str, Any]:
    """status.pools[].performance: the figures used and where they come from, and the measurement's progress."""
    entry: dict[str, Any] = {"source": figures.source if figures else "none"}
    if figures is not None:
        entry.update(itlAlphaMs=round(figures.itl_alpha_ms, 4), itlBetaMs=round(figures.itl_beta_ms, 4),
                     prefillTokensPerSecond=round(figures.prefill_tokens_per_s, 1), maxNumSeqs=figures.max_num_seqs,
                     contextTokens=CONTEXT_TOKENS)  # fmt: skip
    if measurement is not None:
        entry.update(cacheKey=measurement.key, nodeKind=measurement.node_kind)
        optional = {"measuredAt": measurement.measured_at, "job": measurement.job,
                    "attempt": measurement.attempt or None, "lastFailure": measurement.last_failure,
                    "nextAttemptAt": measurement.next_attempt_at}  # fmt: skip
        entry.update({k: v for k, v in optional.items() if v})
    return entry

