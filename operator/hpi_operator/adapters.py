"""spec.adapters on the cluster, as pure functions (adapter_sync.py carries them out):

- where each adapter is in the pods: a Hugging Face adapter at `adapters/<org>/<name>/<revision>/` on the model
  cache claim, downloaded once by a Job (the runtime's downloader with `--adapter`: adapter_config.json and
  adapter_model.safetensors, verified); a `path` adapter in the model's volume, available at once;
- the adapters ConfigMap: per pool, the available adapters it serves as `--lora-modules` entries (vLLM's JSON
  form), which a starting pod loads (`--lora-modules @file`, manifests.py), so a restarted pod serves what the
  spec says;
- what one running pod must load and unload, from its `GET /v1/models` (adapters are the entries with a
  `parent`), and status.adapters: each adapter's download phase and on how many of the ready pods that should
  have it it is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .adapter_spec import AdapterSpec
from .cache import COMPLETE, FAILED, JobState, build_adapter_job
from .manifests import (
    CACHE_VOLUME_MOUNT,
    MODEL_MOUNT,
    Owner,
    adapters_configmap_key,
    adapters_configmap_name,
    cache_claim_name,
    common_labels,
    selector_labels,
    short_name,
    stamp_hash,
)
from .names import LABEL_COMPONENT
from .spec import InferenceSpec

COMPONENT = "adapters"
DOWNLOADING, DOWNLOAD_FAILED, AVAILABLE, LOADED, PARTIAL = "Downloading", "Failed", "Available", "Loaded", "Partial"


def adapter_dir(spec: InferenceSpec, adapter: AdapterSpec) -> str:
    """The adapter's directory as the runtime pods (and the download Job) see it."""
    if adapter.hf_id:
        return f"{CACHE_VOLUME_MOUNT}/adapters/{adapter.hf_id}/{adapter.hf_revision.replace('/', '--')}"
    root = MODEL_MOUNT if spec.model.source == "pvc" else CACHE_VOLUME_MOUNT
    return f"{root}/{adapter.path}"


def adapter_job(owner: Owner, spec: InferenceSpec, adapter: AdapterSpec, attempt: int = 1) -> dict[str, Any]:
    """The download Job of a Hugging Face adapter (its name changes with what it downloads)."""
    assert adapter.hf_id
    return build_adapter_job(owner, spec, cache_claim_name(owner.name, spec), adapter.hf_id, adapter.hf_revision,
                             adapter_dir(spec, adapter), attempt)  # fmt: skip


@dataclass(frozen=True)
class Download:
    """Where one adapter's files stand."""

    phase: str  # Downloading | Failed | Available
    message: str = ""


def download_of(adapter: AdapterSpec, job: JobState | None) -> Download:
    if not adapter.hf_id:
        return Download(AVAILABLE, "on the model's volume")
    if job is None:
        return Download(DOWNLOADING, "download Job not created yet")
    if job.phase == COMPLETE:
        return Download(AVAILABLE, f"downloaded by Job {job.name}")
    if job.phase == FAILED:
        reason = job.message or "the download pod failed"
        return Download(DOWNLOAD_FAILED, f"Job {job.name} attempt {job.attempt} failed: {reason}")
    return Download(DOWNLOADING, f"Job {job.name} attempt {job.attempt}: {job.phase.lower()}")


def wanted_on(spec: InferenceSpec, pool_label: str | None, downloads: Mapping[str, Download]) -> dict[str, str]:
    """{adapter name: directory} that a pod of the pool labelled `pool_label` (short_name of the pool) serves:
    the adapters for that pool whose files are available."""
    return {
        a.name: adapter_dir(spec, a) for a in spec.adapters
        if downloads.get(a.name, Download(DOWNLOADING)).phase == AVAILABLE
        and (not a.pools or pool_label in {short_name(p) for p in a.pools})
    }  # fmt: skip


def build_adapters_configmap(owner: Owner, spec: InferenceSpec, served_name: str, pools: Sequence[str],
                             downloads: Mapping[str, Download]) -> dict[str, Any]:  # fmt: skip
    """Each pool's `--lora-modules` list (vLLM's JSON entries), keyed as the Deployments mount it. Not labelled as
    a child of the plan (the reconciler's prune would delete it: its content follows the downloads, which the plan
    does not know); adopted by the InferenceDeployment, so it goes with it."""
    data = {}
    for pool in sorted(set(pools)):
        wanted = wanted_on(spec, short_name(pool), downloads)
        entries = [{"name": name, "path": path, "base_model_name": served_name} for name, path in wanted.items()]
        data[adapters_configmap_key(pool)] = json.dumps(entries, indent=1) + "\n"
    selector = selector_labels(owner.name)
    labels = {k: v for k, v in common_labels(owner.name).items() if k not in selector}
    return stamp_hash({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": adapters_configmap_name(owner.name), "namespace": owner.namespace,
                     "labels": {**labels, LABEL_COMPONENT: COMPONENT}, "annotations": {}},
        "data": data,
    })  # fmt: skip


@dataclass(frozen=True)
class PodChanges:
    """What one pod must do to serve exactly its wanted adapters: unload first (a changed directory is an unload
    and a load), then load."""

    unload: tuple[str, ...] = ()
    load: tuple[tuple[str, str], ...] = ()  # (name, directory)

    def __bool__(self) -> bool:
        return bool(self.unload or self.load)


def loaded_adapters(models: Mapping[str, Any]) -> dict[str, str]:
    """A pod's `GET /v1/models` answer -> {adapter name: its directory (root)}: the entries with a parent."""
    data = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(data, list):
        raise ValueError(f"not a model list: {str(models)[:200]}")
    return {m["id"]: str(m.get("root") or "") for m in data
            if isinstance(m, Mapping) and m.get("parent") and isinstance(m.get("id"), str)}  # fmt: skip


def pod_changes(wanted: Mapping[str, str], loaded: Mapping[str, str]) -> PodChanges:
    unload = tuple(sorted(n for n, path in loaded.items() if n not in wanted or wanted[n] != path))
    load = tuple(sorted((n, path) for n, path in wanted.items() if loaded.get(n) != path))
    return PodChanges(unload, load)


def adapters_status(spec: InferenceSpec, downloads: Mapping[str, Download], wanted_pods: Mapping[str, int],
                    loaded_pods: Mapping[str, int]) -> list[dict[str, Any]]:  # fmt: skip
    """status.adapters, in spec order. `wanted_pods`/`loaded_pods`: per adapter, the ready pods that should have it
    and those that answered with it loaded."""
    entries = []
    for adapter in spec.adapters:
        download = downloads.get(adapter.name, Download(DOWNLOADING))
        wanted, loaded = wanted_pods.get(adapter.name, 0), loaded_pods.get(adapter.name, 0)
        phase, message = download.phase, download.message
        if phase == AVAILABLE and wanted:
            phase = LOADED if loaded >= wanted else PARTIAL
            message = f"loaded on {loaded} of {wanted} ready pod(s)"
        entries.append({"name": adapter.name, "source": adapter.source, "phase": phase,
                        "path": adapter_dir(spec, adapter), "loadedPods": loaded, "wantedPods": wanted,
                        "message": message})  # fmt: skip
    return entries
