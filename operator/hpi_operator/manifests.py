"""Pure builders of the child objects: one Deployment per pool and one PodDisruptionBudget (the Services and
the rest of what routes requests to the pods: routing_manifests.py).

The runtime container's command line is the contract with `hpi serve` (runtime/hpi_runtime/cli.py): every
flag below is one it accepts (a test parses the rendered args with the runtime's own parser when available).
Children carry no owner references here; `plan.py` adopts them (kopf.adopt).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpi_contracts.serve import serve_args

from .names import (
    ANNOTATION_SPEC_HASH,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_POOL,
    OPERATOR_NAME,
    RUNTIME_NAME,
    RUNTIME_PORT,
    RUNTIME_PORT_NAME,
)
from .nodes import Pool
from .profiles import GPU_HOST_MEMORY_BYTES, Profile
from .sizing import EMBEDDED_MODEL_NAME
from .spec import InferenceSpec

MODEL_MOUNT = "/models"
CACHE_MOUNT = "/cache"
CACHE_VOLUME_MOUNT = "/model-cache"  # spec.model.cache: the shared (or node-local) model cache volume
# The same volume's `compile-cache/` directory, writable: what the runtime compiles at start-up, so the next pod of
# the same model and profile skips it (hpi serve --compile-cache-dir; keyed and shared safely by the runtime).
COMPILE_CACHE_MOUNT = "/compile-cache"
COMPILE_CACHE_SUBPATH = "compile-cache"
PRESTOP_SLEEP_S = 5  # lets endpoints controllers drop the pod before the runtime stops accepting work
API_KEY_ENV = "HPI_API_KEY"
DEFAULT_CPU_REQUEST = {"cuda": "2", "cpu": "4"}


@dataclass(frozen=True)
class Owner:
    """The InferenceDeployment the children belong to."""

    name: str
    namespace: str


def container_security_context() -> dict[str, Any]:
    """Every container the operator runs: the restricted Pod Security Standard, read-only root."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}  # fmt: skip


def pod_security_context() -> dict[str, Any]:
    """Every pod the operator runs: non-root (the images' uid 1000), RuntimeDefault seccomp."""
    return {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip


def short_name(text: str, limit: int = 63) -> str:
    """`text` cut to `limit` characters, with a hash suffix when cut, so distinct inputs stay distinct."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{text[: limit - 9].rstrip('-.')}-{digest}"


def selector_labels(owner_name: str) -> dict[str, str]:
    """The labels that select every runtime pod of one InferenceDeployment (Service, PDB, scale selector)."""
    return {LABEL_DEPLOYMENT: short_name(owner_name)}


def label_selector(owner_name: str, **extra: str) -> str:
    """The one label selector string of this InferenceDeployment's objects (`extra`: more equality terms):
    status.selector for the scale subresource, the prune's and the cache Jobs' lists."""
    return ",".join(f"{k}={v}" for k, v in {**selector_labels(owner_name), **extra}.items())


def common_labels(owner_name: str) -> dict[str, str]:
    return {
        LABEL_NAME: RUNTIME_NAME,
        LABEL_INSTANCE: short_name(owner_name),
        LABEL_COMPONENT: "inference",
        LABEL_MANAGED_BY: OPERATOR_NAME,
        **selector_labels(owner_name),
    }


def deployment_name(owner_name: str, pool_name: str) -> str:
    return short_name(f"{owner_name}-{pool_name}")


def served_model_name(owner_name: str, spec: InferenceSpec) -> str:
    if spec.model.served_name:
        return spec.model.served_name
    if spec.model.source == "embedded":
        return EMBEDDED_MODEL_NAME
    if spec.model.source == "huggingface" and spec.model.hf_id:
        return spec.model.hf_id
    return owner_name


def spec_hash(manifest: Mapping[str, Any]) -> str:
    """A stable hash of a manifest, ignoring the hash annotation itself."""
    body = copy.deepcopy(dict(manifest))
    body.get("metadata", {}).get("annotations", {}).pop(ANNOTATION_SPEC_HASH, None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def stamp_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    manifest.setdefault("metadata", {}).setdefault("annotations", {})[ANNOTATION_SPEC_HASH] = spec_hash(manifest)
    return manifest


def bytes_to_quantity(num_bytes: int) -> str:
    """Bytes rounded up to whole MiB, written the way kubectl users read them ("17408Mi")."""
    return f"{max(1, math.ceil(num_bytes / 2**20))}Mi"


RUNTIME_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # `hpi serve --dtype` spellings


def cache_model_dir(spec: InferenceSpec) -> str:
    """The wanted revision's directory on the model cache volume: one directory per revision."""
    return f"{CACHE_VOLUME_MOUNT}/models/{spec.model.hf_id}/{spec.model.hf_revision.replace('/', '--')}"


def uses_cache(spec: InferenceSpec, volume: str) -> bool:
    cache = spec.model.cache
    return spec.model.source == "huggingface" and cache.enabled and cache.volume == volume


def uses_cache_volume(spec: InferenceSpec) -> bool:
    """The pods mount a model cache volume (shared claim or node-local directory)."""
    return uses_cache(spec, "persistentVolumeClaim") or uses_cache(spec, "hostPath")


def model_dir(spec: InferenceSpec, cached_dir: str | None = None) -> str | None:
    """Where the runtime finds the model directory; None for the embedded model (the runtime's default).

    With a shared cache, `cached_dir` is the revision the cache holds complete (it may lag the spec while
    a new revision downloads)."""
    if spec.model.source == "pvc":
        return "/".join(p for p in (MODEL_MOUNT, spec.model.pvc_path) if p)
    if uses_cache(spec, "persistentVolumeClaim"):
        return cached_dir or cache_model_dir(spec)
    if uses_cache(spec, "hostPath"):
        return cache_model_dir(spec)
    if spec.model.source == "huggingface" and spec.model.hf_id:
        return f"{CACHE_MOUNT}/models/{spec.model.hf_id}"
    return None


# --pool-profile @file: the pool's profile ConfigMap (profiling.py) mounted as a directory, so the kubelet's in-place
# updates reach the running pods (a subPath mount would never see them).
POOL_PROFILE_MOUNT = "/etc/hpi/pool-profile"
POOL_PROFILE_FILE = "profile.json"
# spec.adapters (adapters.py): the pool's list of available adapters, in the adapters ConfigMap, mounted as a
# directory (kubelet updates reach the pod) and passed as `--lora-modules @file`: what a starting pod loads. Running
# pods get later changes through their admin endpoints (adapter_sync.py), which VLLM_ALLOW_RUNTIME_LORA_UPDATING
# turns on, as in vLLM.
ADAPTERS_MOUNT = "/etc/hpi/adapters"
ADAPTERS_FILE = "lora-modules.json"
ALLOW_LORA_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# The flags of `hpi serve` that are the HTTP server's: `hpi profile` takes the rest (the engine's) alone. The LoRA
# flags are left out of profiling too: a pool is measured on its base model.
SERVER_ONLY_FLAGS = ("--host", "--port", "--served-model-name", "--drain-timeout", "--pool-profile", "--enable-lora",
                     "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-dtype")  # fmt: skip


def runtime_args(owner_name: str, spec: InferenceSpec, profile: Profile, cached_dir: str | None = None,
                 pool_profile: str | None = None) -> list[str]:  # fmt: skip
    """Arguments of `hpi serve` for one profile, through the flag contract (hpi_contracts.serve_flags, generated
    from the runtime's config tree): a flag the runtime lacks is a ValueError here. None leaves a flag out.
    `pool_profile`: the --pool-profile value (the mounted file, @PATH)."""
    flags = serve_args({**_serve_values(owner_name, spec, profile, cached_dir), "--pool-profile": pool_profile})
    return ["serve", *flags, *spec.runtime.extra_args]


def engine_args(owner_name: str, spec: InferenceSpec, profile: Profile, cached_dir: str | None = None) -> list[str]:
    """The engine flags of `runtime_args` alone: what `hpi profile` needs to load and run the model exactly as the
    pool's pods do (spec.runtime.extraArgs are left out: they may hold server flags `hpi profile` lacks)."""
    values = _serve_values(owner_name, spec, profile, cached_dir)
    return serve_args({flag: value for flag, value in values.items() if flag not in SERVER_ONLY_FLAGS})


def _serve_values(owner_name: str, spec: InferenceSpec, profile: Profile, cached_dir: str | None) -> dict[str, Any]:
    engine = spec.engine
    prequantized_or_none = profile.quantization == "none" or profile.prequantized
    return {
        "--host": "0.0.0.0",
        "--port": RUNTIME_PORT,
        "--model": model_dir(spec, cached_dir) or None,
        "--served-model-name": served_model_name(owner_name, spec),
        "--device": profile.device,
        "--dtype": RUNTIME_DTYPES[profile.dtype],
        "--max-model-len": engine.max_model_len,
        "--max-num-seqs": engine.max_num_seqs,
        "--block-size": engine.block_size,
        "--kv-cache-dtype": None if profile.kv_cache_dtype == "auto" else profile.kv_cache_dtype,
        # Per tensor-parallel rank, as the runtime reads it: the profile's KV bytes are the whole replica's.
        "--kv-cache-memory": profile.kv_cache_bytes_per_gpu,
        "--drain-timeout": spec.runtime.drain_timeout_s,
        "--kv-offload-bytes": profile.kv_offload_bytes_per_gpu if profile.kv_offload_bytes else None,
        # Weight-only int8/int4 applied by the runtime at load time; a pre-quantized checkpoint is detected by
        # the runtime from its config.json and needs (and takes) no flag.
        "--quantization": None if prequantized_or_none else profile.quantization,
        "--max-num-batched-tokens": engine.max_num_batched_tokens or None,
        "--tensor-parallel-size": profile.num_gpus if profile.num_gpus > 1 else None,
        # A group (manifests_lws.py): one stage per pod; the runtime reads the group's size, this pod's index and
        # the leader's address from the variables LeaderWorkerSet sets (LWS_GROUP_SIZE, LWS_WORKER_INDEX,
        # LWS_LEADER_ADDRESS), so every pod of the group runs this same command line.
        "--pipeline-parallel-size": profile.num_nodes if profile.multi_node else None,
        "--compile-cache-dir": COMPILE_CACHE_MOUNT if uses_cache_volume(spec) else None,
        **_lora_values(spec),
    }  # fmt: skip


def _lora_values(spec: InferenceSpec) -> dict[str, Any]:
    if not spec.adapters:
        return {}
    engine = spec.engine
    return {
        "--enable-lora": True,
        "--lora-modules": f"@{ADAPTERS_MOUNT}/{ADAPTERS_FILE}",
        "--max-loras": engine.max_loras,
        "--max-lora-rank": engine.max_lora_rank,
        "--max-cpu-loras": engine.max_cpu_loras or max(len(spec.adapters), engine.max_loras),
        "--lora-dtype": engine.lora_dtype,
    }


def adapters_configmap_name(owner_name: str) -> str:
    return short_name(f"{owner_name}-adapters")


def adapters_configmap_key(pool_name: str) -> str:
    """The key of a pool's adapter list in the adapters ConfigMap."""
    return f"{short_name(pool_name)}.json"


# The runtime's own downloader (same image, runtime/hpi_runtime/download.py): configs first, then only the
# shards its loader reads, each verified by size and hash; resumable; a completion marker written last.
DOWNLOADER = ["python", "-m", "hpi_runtime.download"]


def _fetch_container(spec: InferenceSpec, container: dict[str, Any]) -> dict[str, Any]:
    """An init container (same image) that downloads a Hugging Face model into the pod's (or node's) cache."""
    mounts = [{k: v for k, v in m.items() if k != "readOnly"} for m in container["volumeMounts"]
              if m["mountPath"] != COMPILE_CACHE_MOUNT]  # fmt: skip
    return {
        "name": "fetch-model",
        "image": container["image"],  # the pod's own image: an AMD node pulls only the ROCm one
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": DOWNLOADER,
        "args": ["fetch", spec.model.hf_id or "", model_dir(spec) or "", "--revision", spec.model.hf_revision],
        "env": container["env"],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": mounts,
        "securityContext": container["securityContext"],
    }


def _check_cache_container(container: dict[str, Any], directory: str) -> dict[str, Any]:
    """An init container that keeps the runtime from starting on a partial cache (no completion marker)."""
    return {
        "name": "check-model-cache",
        "image": container["image"],
        "imagePullPolicy": container["imagePullPolicy"],
        "command": DOWNLOADER,
        "args": ["check", directory],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        "volumeMounts": [m for m in container["volumeMounts"] if m["mountPath"] in (CACHE_VOLUME_MOUNT, "/tmp")],
        "securityContext": container["securityContext"],
    }


def runtime_image(spec: InferenceSpec, pool: Pool) -> str:
    """The runtime image for a pool: torch is built for one GPU platform, so AMD pools run the ROCm build
    (spec.runtime.rocmImage), every other pool (NVIDIA, CPU) the CUDA one (spec.runtime.image)."""
    return spec.runtime.rocm_image if pool.device == "cuda" and pool.gpu_vendor == "amd" else spec.runtime.image


def _resources(spec: InferenceSpec, profile: Profile, gpu_resource: str) -> dict[str, Any]:
    user = copy.deepcopy(dict(spec.resources))
    requests: dict[str, Any] = dict(user.get("requests") or {})
    limits: dict[str, Any] = dict(user.get("limits") or {})
    requests.setdefault("cpu", DEFAULT_CPU_REQUEST[profile.device])
    if profile.device == "cpu":
        # The weights, KV cache and overhead the profile was sized for are the pod's memory.
        memory = bytes_to_quantity(profile.needed_bytes)
    else:
        # Host RAM for the process, plus the pinned host KV tier when the profile has one.
        memory = bytes_to_quantity(GPU_HOST_MEMORY_BYTES + profile.kv_offload_bytes)
    requests.setdefault("memory", limits.get("memory", memory))
    limits.setdefault("memory", requests["memory"])
    if profile.num_gpus:
        requests[gpu_resource] = str(profile.num_gpus)
        limits[gpu_resource] = str(profile.num_gpus)
    return {"requests": requests, "limits": limits}


def _env(spec: InferenceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"}]
    if spec.api_key_secret:
        ref = {"name": spec.api_key_secret.name, "key": spec.api_key_secret.key}
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": ref}})
    if spec.adapters:
        env.append({"name": ALLOW_LORA_UPDATES_ENV, "value": "true"})
    token = spec.model.hf_token_secret
    if spec.model.source == "huggingface" and token and not uses_cache(spec, "persistentVolumeClaim"):
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    return env + [dict(e) for e in spec.runtime.env]


def cache_claim_name(owner_name: str, spec: InferenceSpec) -> str:
    """The model cache's claim: the one spec.model.cache names, else the one the operator creates."""
    return spec.model.cache.claim_name or short_name(f"{owner_name}-model-cache")


def _volumes(
    owner_name: str, spec: InferenceSpec, profile: Profile
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_MOUNT},
    ]
    if profile.device == "cuda":
        # The default 64 MiB /dev/shm is too small for torch's CUDA IPC and pinned staging buffers.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.model.source == "pvc":
        claim = {"claimName": spec.model.pvc_claim_name, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    if uses_cache(spec, "persistentVolumeClaim"):
        # Not readOnly on the claim (that would make every mount of it read-only): the models mount is, the
        # compile cache's is not.
        claim = {"claimName": cache_claim_name(owner_name, spec)}
        volumes.append({"name": "model-cache", "persistentVolumeClaim": claim})
    if uses_cache(spec, "hostPath"):
        host = {"path": spec.model.cache.host_path, "type": "DirectoryOrCreate"}
        volumes.append({"name": "model-cache", "hostPath": host})
    if uses_cache_volume(spec):
        mounts.append({"name": "model-cache", "mountPath": CACHE_VOLUME_MOUNT, "readOnly": True})
        mounts.append({"name": "model-cache", "mountPath": COMPILE_CACHE_MOUNT, "subPath": COMPILE_CACHE_SUBPATH})
    return volumes, mounts


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": RUNTIME_PORT_NAME},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _affinity(pool: Pool) -> dict[str, Any] | None:
    if not pool.match_expressions:
        return None
    terms = [{"matchExpressions": [dict(e) for e in pool.match_expressions]}]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


def pod_template(
    owner: Owner, spec: InferenceSpec, pool: Pool, profile: Profile, cached_dir: str | None = None,
    pool_profile_configmap: str | None = None,
) -> dict[str, Any]:
    """The runtime pod template of `profile` on `pool` (from `cached_dir`, the complete revision on the shared model
    cache, when there is one): the template of a pool's Deployment, and of a group's leader (manifests_lws.py).
    `pool_profile_configmap`: the pool's profile ConfigMap, mounted and passed as `--pool-profile @file` (the
    template stays the same when the figures change: no rollout)."""
    labels = {**common_labels(owner.name), LABEL_POOL: short_name(pool.name)}
    volumes, mounts = _volumes(owner.name, spec, profile)
    pool_profile = f"@{POOL_PROFILE_MOUNT}/{POOL_PROFILE_FILE}" if pool_profile_configmap else None
    container = {
        "name": "runtime",
        "image": runtime_image(spec, pool),
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": ["hpi"],
        "args": runtime_args(owner.name, spec, profile, cached_dir, pool_profile),
        "ports": [{"name": RUNTIME_PORT_NAME, "containerPort": RUNTIME_PORT, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": _resources(spec, profile, pool.gpu_resource),
        # Loading a large model takes minutes: the startup probe holds liveness off until /health answers.
        "startupProbe": _probe("/health", 10, 90),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 2),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": dict(pool.node_selector),
        "tolerations": [dict(t) for t in pool.tolerations],
        # SIGTERM makes the runtime drain: readiness false, finish in-flight work, exit 0.
        "terminationGracePeriodSeconds": PRESTOP_SLEEP_S + spec.runtime.drain_timeout_s + 10,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": pool_pod_selector(owner.name, pool.name)},
            }
        ],
    }
    if uses_cache(spec, "persistentVolumeClaim"):
        pod_spec["initContainers"] = [_check_cache_container(container, model_dir(spec, cached_dir) or "")]
    elif spec.model.source == "huggingface":  # node-local cache, or a download into the pod's own volume
        pod_spec["initContainers"] = [_fetch_container(spec, container)]
    if pool_profile_configmap:  # the runtime container's alone (after the init containers copied its mounts)
        volumes.append({"name": "pool-profile", "configMap": {"name": pool_profile_configmap, "optional": True}})
        mounts.append({"name": "pool-profile", "mountPath": POOL_PROFILE_MOUNT, "readOnly": True})
    if spec.adapters:  # optional: a pod that starts before the operator wrote the list starts with no adapter
        items = [{"key": adapters_configmap_key(pool.name), "path": ADAPTERS_FILE}]
        volumes.append({"name": "adapters",
                        "configMap": {"name": adapters_configmap_name(owner.name), "items": items, "optional": True}})
        mounts.append({"name": "adapters", "mountPath": ADAPTERS_MOUNT, "readOnly": True})
    affinity = _affinity(pool)
    if affinity:
        pod_spec["affinity"] = affinity
    if spec.runtime.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.runtime.image_pull_secrets]
    return {
        "metadata": {
            "labels": labels,
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(RUNTIME_PORT),
                "prometheus.io/path": "/metrics",
                "kubectl.kubernetes.io/default-container": "runtime",
            },
        },
        "spec": pod_spec,
    }


def pool_pod_selector(owner_name: str, pool_name: str) -> dict[str, str]:
    """The labels of one pool's serving pods (a Deployment's selector; a group's leaders)."""
    return {**selector_labels(owner_name), LABEL_POOL: short_name(pool_name)}


def build_deployment(
    owner: Owner, spec: InferenceSpec, pool: Pool, profile: Profile, replicas: int, cached_dir: str | None = None,
    pool_profile_configmap: str | None = None,
) -> dict[str, Any]:
    """The Deployment that runs `replicas` runtime pods with `profile` on `pool` (pod_template says the rest)."""
    template = pod_template(owner, spec, pool, profile, cached_dir, pool_profile_configmap)
    # GPU pools rarely have a spare GPU for a surge pod: replace one pod at a time instead.
    rolling = {"maxSurge": 0, "maxUnavailable": 1} if profile.device == "cuda" else {"maxSurge": 1, "maxUnavailable": 0}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(owner.name, pool.name),
            "namespace": owner.namespace,
            "labels": dict(template["metadata"]["labels"]),
            "annotations": {},
        },
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": pool_pod_selector(owner.name, pool.name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": template,
        },
    }


def build_pdb(owner: Owner) -> dict[str, Any]:
    """At most one runtime pod of this InferenceDeployment evicted at a time (node drains, upgrades)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": short_name(owner.name),
            "namespace": owner.namespace,
            "labels": common_labels(owner.name),
            "annotations": {},
        },
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner.name)}},
    }
