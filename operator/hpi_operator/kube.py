"""The operator's Kubernetes client: raw JSON calls through the kubernetes client's transport, and the REST
paths of every kind it writes (plain dicts in and out: the generated models are not needed for objects the
operator builds itself). What it writes and how: children.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import urllib3
from kubernetes import client, config

from . import __version__

_PATHS = {
    "InferenceDeployment": "/apis/serving.hpi.dev/v1alpha1/namespaces/{namespace}/inferencedeployments",
    "Deployment": "/apis/apps/v1/namespaces/{namespace}/deployments",
    "Service": "/api/v1/namespaces/{namespace}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets",
    "PersistentVolumeClaim": "/api/v1/namespaces/{namespace}/persistentvolumeclaims",
    "Job": "/apis/batch/v1/namespaces/{namespace}/jobs",
    # Pool profiles (profiling.py): the cache and the pools' ConfigMaps; the profiling Jobs' pods, read for their
    # termination message.
    "ConfigMap": "/api/v1/namespaces/{namespace}/configmaps",
    "Pod": "/api/v1/namespaces/{namespace}/pods",
    # The routing objects (routing_manifests.py).
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools",
    # Pools whose replicas span nodes (manifests_lws.py): the LeaderWorkerSet API, when installed.
    "LeaderWorkerSet": "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{namespace}/leaderworkersets",
    # spec.networkPolicy (network_policies.py).
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
    # The external autoscalers (autoscaling/manifests.py).
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers",
    "ScaledObject": "/apis/keda.sh/v1alpha1/namespaces/{namespace}/scaledobjects",
}


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
        try:
            response = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
            data = response.read()
        except urllib3.exceptions.HTTPError as e:  # no answer (timeout, connection refused): retried like a 503
            raise KubeError(503, f"{method} {path}: {e}") from e
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


def object_path(kind: str, namespace: str, name: str) -> str:
    return f"{collection_path(kind, namespace)}/{name}"


def with_query(path: str, **params: str) -> str:
    return path + "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in params.items())
