"""Driving spec.adapters on the cluster (the I/O half of adapters.py): a timer per InferenceDeployment with
adapters (or an adapter status left to clear), every `interval_s`:

1. Downloads: for each Hugging Face adapter, its Job onto the model cache claim (created, or after a failure
   replaced with the next attempt once cache.retry_delay_s has passed, as the model's own); Jobs of adapters no
   longer in the spec are deleted (the files stay on the claim).
2. The adapters ConfigMap: each pool's available adapters, which a starting pod loads (adapters.py).
3. The running pods (the ready runtime pods, from the autoscaler's index): each one's `GET /v1/models` against
   what its pool should serve, then `POST /v1/unload_lora_adapter` and `/v1/load_lora_adapter` (vLLM's admin
   endpoints) for the difference. A call that fails is retried on the next tick; a 400 on load (a bad adapter
   directory) is a Warning Event once per adapter and message.
4. status.adapters and Events.
Everything it remembers is on the cluster: the Jobs, the ConfigMap, the pods' own lists, the status.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from .adapters import (
    DOWNLOAD_FAILED,
    Download,
    PodChanges,
    adapter_job,
    adapters_status,
    build_adapters_configmap,
    download_of,
    loaded_adapters,
    pod_changes,
    wanted_on,
)
from .autoscaling.scrape import PodTarget
from .autoscaling.sleep import base_url
from .cache import FAILED, LABEL_CACHE_JOB, RETRY_BASE_DELAY_S, JobState, retry_delay_s
from .cache_sync import _delete_job, _next_attempt, _parse_time
from .children import apply_object
from .kube import KubeClient, collection_path, with_query
from .manifests import Owner, label_selector, served_model_name, short_name
from .names import GROUP, LABEL_COMPONENT, PLURAL, VERSION
from .spec import InferenceSpec, SpecError, parse_spec

DEFAULT_INTERVAL_S = 10.0
CALL_TIMEOUT_S = 60.0  # a load reads the adapter's files and fills a host slot


@dataclass(frozen=True)
class PodResult:
    """One pod's adapters after this tick's calls, and the calls that failed (adapter, detail)."""

    pod: str
    loaded: frozenset[str]
    failures: tuple[tuple[str, str], ...] = ()


def _adapter_jobs(kube: KubeClient, owner: Owner, owner_uid: str | None) -> dict[str, dict[str, Any]]:
    selector = label_selector(owner.name, **{LABEL_COMPONENT: "model-cache", LABEL_CACHE_JOB: "adapter"})
    listing = kube.request("GET", with_query(collection_path("Job", owner.namespace), labelSelector=selector))
    return {
        item["metadata"]["name"]: item for item in listing.get("items") or []
        if owner_uid is None or any(r.get("uid") == owner_uid for r in item["metadata"].get("ownerReferences") or [])
    }  # fmt: skip


def sync_downloads(kube: KubeClient, body: Mapping[str, Any], spec: InferenceSpec, now: str,
                   retry_base_s: float = RETRY_BASE_DELAY_S) -> dict[str, Download]:  # fmt: skip
    """Step 1: each adapter's Download, its Job created or retried; stale adapter Jobs deleted."""
    meta = body["metadata"]
    owner = Owner(meta["name"], meta.get("namespace") or "default")
    existing = _adapter_jobs(kube, owner, meta.get("uid"))
    downloads: dict[str, Download] = {}
    wanted_jobs: set[str] = set()
    for adapter in spec.adapters:
        if not adapter.hf_id:
            downloads[adapter.name] = download_of(adapter, None)
            continue
        job = adapter_job(owner, spec, adapter)
        kopf.adopt(job, owner=dict(body))
        name = job["metadata"]["name"]
        wanted_jobs.add(name)
        live = existing.get(name)
        if live is None:
            live = kube.request("POST", collection_path("Job", owner.namespace), job)
        state = JobState.from_job(live)
        if state.phase == FAILED:
            failed_at = _parse_time(state.finished_at) or _parse_time(now)
            retry_at = failed_at + datetime.timedelta(seconds=retry_delay_s(state.attempt, retry_base_s))
            if _parse_time(now) >= retry_at:  # type: ignore[operator]
                _delete_job(kube, owner.namespace, name)
                retry = _next_attempt(job, state.attempt + 1)
                live = kube.request("POST", collection_path("Job", owner.namespace), retry)
                state = JobState.from_job(live)
        downloads[adapter.name] = download_of(adapter, state)
    for name in existing.keys() - wanted_jobs:
        _delete_job(kube, owner.namespace, name)
    return downloads


def apply_configmap(kube: KubeClient, body: Mapping[str, Any], spec: InferenceSpec, pools: Sequence[str],
                    downloads: Mapping[str, Download]) -> None:  # fmt: skip
    """Step 2."""
    meta = body["metadata"]
    owner = Owner(meta["name"], meta.get("namespace") or "default")
    configmap = build_adapters_configmap(owner, spec, served_model_name(owner.name, spec), pools, downloads)
    kopf.adopt(configmap, owner=dict(body))
    apply_object(kube, configmap)


async def _call(session: aiohttp.ClientSession, method: str, url: str, payload: Any = None) -> tuple[int, str]:
    try:
        async with session.request(method, url, json=payload) as response:
            return response.status, (await response.text())[:500]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return 0, f"unreachable: {e or type(e).__name__}"


async def sync_pod(session: aiohttp.ClientSession, target: PodTarget, wanted: Mapping[str, str]) -> PodResult:
    """Step 3 for one pod: list, unload, load; what it has loaded afterwards."""
    base = base_url(target)
    status, text = await _call(session, "GET", f"{base}/v1/models")
    if status != 200:
        return PodResult(target.pod, frozenset(), (("*", f"GET /v1/models: {status} {text}"),))
    try:
        loaded = loaded_adapters(json.loads(text))
    except ValueError as e:
        return PodResult(target.pod, frozenset(), (("*", f"GET /v1/models: {e}"),))
    changes: PodChanges = pod_changes(wanted, loaded)
    have, failures = set(loaded), []
    for name in changes.unload:
        status, text = await _call(session, "POST", f"{base}/v1/unload_lora_adapter", {"lora_name": name})
        if status == 200 or status == 404:  # 404: it was gone already
            have.discard(name)
        else:
            failures.append((name, f"unload: {status} {text}"))
    for name, path in changes.load:
        if name in have:
            continue  # its unload failed: a load would answer "already loaded"
        status, text = await _call(session, "POST", f"{base}/v1/load_lora_adapter",
                                   {"lora_name": name, "lora_path": path})  # fmt: skip
        if status == 200:
            have.add(name)
        else:
            failures.append((name, f"load: {status} {text}"))
    return PodResult(target.pod, frozenset(have), tuple(failures))


async def sync_pods(targets: Sequence[PodTarget], spec: InferenceSpec, downloads: Mapping[str, Download],
                    timeout_s: float = CALL_TIMEOUT_S) -> tuple[list[PodResult], Counter, Counter]:  # fmt: skip
    """Step 3 for every pod, concurrently; with, per adapter, the pods that should have it and those that do."""
    wanted = {t.pod: wanted_on(spec, t.pool, downloads) for t in targets}
    if not targets:
        return [], Counter(), Counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        results = list(await asyncio.gather(*(sync_pod(session, t, wanted[t.pod]) for t in targets)))
    wanted_pods = Counter(name for t in targets for name in wanted[t.pod])
    loaded_pods = Counter(name for r in results for name in r.loaded if name in wanted[r.pod])
    return results, wanted_pods, loaded_pods


def failure_events(old_status: Sequence[Mapping[str, Any]] | None,
                   entries: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """(type, reason, message) Events: a download failure once per failed attempt (its message changes), a pod
    call failure once per adapter and message while it lasts (kept in the entry's message)."""
    before = {e.get("name"): e for e in old_status or [] if isinstance(e, Mapping)}
    events = []
    for entry in entries:
        old = before.get(entry["name"], {})
        if entry["phase"] == DOWNLOAD_FAILED and old.get("message") != entry["message"]:
            events.append(("Warning", "AdapterDownloadFailed", f"{entry['name']}: {entry['message']}"))
        if entry.get("callFailure") and entry["callFailure"] != old.get("callFailure"):
            events.append(("Warning", "AdapterLoadFailed", f"{entry['name']}: {entry['callFailure']}"))
    return events


def _with_call_failures(entries: list[dict[str, Any]], results: Sequence[PodResult]) -> list[dict[str, Any]]:
    by_adapter: dict[str, str] = {}
    for result in results:
        for name, detail in result.failures:
            by_adapter.setdefault(name, f"pod {result.pod}: {detail}")
    for entry in entries:
        failure = by_adapter.get(entry["name"]) or by_adapter.get("*")
        entry["callFailure"] = failure  # explicit null clears it (status is a merge patch)
    return entries


def wants_adapters(spec: Mapping[str, Any], status: Mapping[str, Any], **_: Any) -> bool:
    """kopf `when=` filter: adapters in the spec, or an adapter status to remove."""
    return bool(isinstance(spec, Mapping) and spec.get("adapters")) or bool((status or {}).get("adapters"))


def register_adapters(registry: kopf.OperatorRegistry, interval_s: float = DEFAULT_INTERVAL_S,
                      call_timeout_s: float = CALL_TIMEOUT_S,
                      retry_base_s: float = RETRY_BASE_DELAY_S) -> None:  # fmt: skip
    @kopf.timer(GROUP, VERSION, PLURAL, id="adapters", interval=interval_s, when=wants_adapters, registry=registry)
    async def adapters(body: kopf.Body, name: str, namespace: str, spec: kopf.Spec, meta: kopf.Meta,
                       status: kopf.Status, patch: kopf.Patch, runtime_pods: kopf.Index, memo: kopf.Memo,
                       **_: Any) -> None:  # fmt: skip
        if meta.get("deletionTimestamp"):
            return
        try:
            parsed = parse_spec(spec)
        except SpecError:
            return  # the reconciler reports it
        if not parsed.adapters:
            patch.status["adapters"] = None
            return
        snapshot = dict(body)
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        downloads = await asyncio.to_thread(sync_downloads, memo.kube, snapshot, parsed, now, retry_base_s)
        pools = [p["name"] for p in status.get("pools") or [] if isinstance(p, Mapping) and p.get("name")]
        await asyncio.to_thread(apply_configmap, memo.kube, snapshot, parsed, pools, downloads)
        targets = [t for targets in runtime_pods.get((namespace, short_name(name)), []) for t in targets]
        results, wanted_pods, loaded_pods = await sync_pods(targets, parsed, downloads, call_timeout_s)
        entries = _with_call_failures(adapters_status(parsed, downloads, wanted_pods, loaded_pods), results)
        old = status.get("adapters")
        for type_, reason, message in failure_events(old, entries):
            kopf.event(body, type=type_, reason=reason, message=message)
        if entries != old:
            patch.status["adapters"] = entries


