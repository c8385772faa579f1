"""Kubernetes I/O for the reconciler: a thin JSON client and the apply/prune of a Plan's children.

Plain dicts in and out (the generated `kubernetes` models are not needed for objects the operator builds
itself). Writes are JSON merge patches (RFC 7386) so lists the operator owns (containers, tolerations,
args) are replaced whole; a child is written only when its spec-hash annotation differs (no churn; server-side
defaults never look like drift), or when a Deployment's replicas were changed by hand.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config

from . import __version__
from .autoscale_manifests import AUTOSCALER_PATHS
from .manifests import selector_labels
from .names import ANNOTATION_SPEC_HASH, LABEL_DEPLOYMENT
from .plan import Plan
from .status import ChildState

MERGE_PATCH = "application/merge-patch+json"

_PATHS = {
    "Deployment": "/apis/apps/v1/namespaces/{namespace}/deployments",
    "Service": "/api/v1/namespaces/{namespace}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets",
    "PersistentVolumeClaim": "/api/v1/namespaces/{namespace}/persistentvolumeclaims",
    "Job": "/apis/batch/v1/namespaces/{namespace}/jobs",
    # The routing objects (routing_manifests.py).
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools",
    **AUTOSCALER_PATHS,  # HorizontalPodAutoscaler, ScaledObject
}
# The kinds one generic prune removes when the plan no longer wants them: Deployments of pools that went away,
# and the routing objects of a mode the spec left (the autoscalers and the model cache prune their own).
PRUNED_KINDS = ("Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Role", "RoleBinding",
                "InferencePool")  # fmt: skip


class KubeError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def load_api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


@dataclass(frozen=True)
class KubeClient:
    """Raw JSON calls through the kubernetes client's configured transport and credentials."""

    api: client.ApiClient
    user_agent: str = f"hpi-operator/{__version__}"

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, _ = self.api.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        headers["User-Agent"] = self.user_agent  # after the client's defaults: audit logs say who wrote
        response = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
        data = response.read()
        if not 200 <= response.status < 300:
            raise KubeError(response.status, data.decode(errors="replace") if data else "")
        return json.loads(data) if data else {}

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except KubeError as e:
            if e.status == 404:
                return None
            raise


def collection_path(kind: str, namespace: str) -> str:
    return _PATHS[kind].format(namespace=namespace)


def _collection(obj: Mapping[str, Any]) -> str:
    return _PATHS[obj["kind"]].format(namespace=obj["metadata"]["namespace"])


def _merge_patch(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """`desired` as a merge patch, with nulls for map keys the operator owns that it no longer wants."""
    patch = json.loads(json.dumps(desired))
    live_pod = ((live.get("spec") or {}).get("template") or {}).get("spec") or {}
    patch_pod = ((patch.get("spec") or {}).get("template") or {}).get("spec")
    if patch_pod is not None:
        for key in live_pod.get("nodeSelector") or {}:
            patch_pod.setdefault("nodeSelector", {}).setdefault(key, None)
        if "affinity" in live_pod and "affinity" not in patch_pod:
            patch_pod["affinity"] = None
    if desired.get("kind") == "Service":  # a routing mode change moves the user-facing Service to other pods
        live_selector = (live.get("spec") or {}).get("selector") or {}
        for key in live_selector:
            patch.setdefault("spec", {}).setdefault("selector", {}).setdefault(key, None)
    return patch


def apply_object(kube: KubeClient, desired: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Create `desired` or bring the live object to it; returns the live object and what was done."""
    path = f"{_collection(desired)}/{desired['metadata']['name']}"
    live = kube.get(path)
    if live is None:
        return kube.request("POST", _collection(desired), dict(desired)), "created"
    if (live.get("metadata") or {}).get("deletionTimestamp"):
        # A child of a pool that was dropped a moment ago and is back: wait until it is gone (409 -> retry).
        raise KubeError(409, f"{desired['kind']} {desired['metadata']['name']} is still terminating")
    live_hash = ((live.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
    # Replicas are the one field people edit by hand (`kubectl scale deployment`): undo that drift too.
    live_replicas = (live.get("spec") or {}).get("replicas")
    replicas_drifted = desired["kind"] == "Deployment" and live_replicas != desired["spec"]["replicas"]
    if live_hash == desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH] and not replicas_drifted:
        return live, "unchanged"
    return kube.request("PATCH", path, _merge_patch(live, desired), MERGE_PATCH), "patched"


def prune_children(kube: KubeClient, plan: Plan, owner_uid: str | None) -> list[str]:
    """Delete children of PRUNED_KINDS this InferenceDeployment owns that the plan no longer wants (a dropped
    pool's Deployment, the router's objects after a switch to another mode); returns "Kind/name" of each.

    A kind the cluster does not serve (no InferencePool CRD) answers 404: nothing of it to prune."""
    wanted = {(c["kind"], c["metadata"]["name"]) for c in plan.children}
    selector = f"{LABEL_DEPLOYMENT}={selector_labels(plan.owner.name)[LABEL_DEPLOYMENT]}"
    deleted = []
    for kind in PRUNED_KINDS:
        path = collection_path(kind, plan.owner.namespace)
        try:
            listing = kube.request("GET", f"{path}?labelSelector={selector}")
        except KubeError as e:
            if e.status == 404:
                continue
            raise
        for item in listing.get("items") or []:
            meta = item.get("metadata") or {}
            owned = owner_uid is None or any(ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or [])
            if owned and (kind, meta.get("name")) not in wanted:
                kube.request("DELETE", f"{path}/{meta['name']}", {"propagationPolicy": "Background"})
                deleted.append(f"{kind}/{meta['name']}")
    return deleted


@dataclass(frozen=True)
class ApplyResult:
    states: dict[str, ChildState]  # by Deployment name
    actions: dict[str, str]  # "Kind/name" -> created | patched | unchanged | deleted


def apply_plan(kube: KubeClient, plan: Plan, owner_uid: str | None) -> ApplyResult:
    """Make the cluster match `plan`: create or patch every child, delete the children it no longer wants."""
    states: dict[str, ChildState] = {}
    actions: dict[str, str] = {}
    for child in plan.children:
        live, action = apply_object(kube, child)
        actions[f"{child['kind']}/{child['metadata']['name']}"] = action
        if child["kind"] == "Deployment":
            states[child["metadata"]["name"]] = ChildState.from_deployment(live)
    if plan.waiting_for_cache:
        return ApplyResult(states=states, actions=actions)  # running pods (cache just enabled) stay for now
    actions.update(dict.fromkeys(prune_children(kube, plan, owner_uid), "deleted"))
    return ApplyResult(states=states, actions=actions)
