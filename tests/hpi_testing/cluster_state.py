"""Reading what the operator left on an emulated cluster: the children an InferenceDeployment owns, and the
write requests the operator sent (the emulator logs every request it served)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# The REST collection of each kind the operator writes (as hpi_operator.kube, spelled out: the tests check it).
COLLECTIONS = {
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
    "ScaledObject": "/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
}
OPERATOR_AGENTS = ("hpi-operator/", "kopf/")
WRITES = {"POST", "PATCH", "PUT", "DELETE"}


def object_path(kind: str, namespace: str, name: str) -> str:
    return f"{COLLECTIONS[kind].format(ns=namespace)}/{name}"


def owned_children(kube: Any, namespace: str, owner_uid: str) -> dict[tuple[str, str], dict[str, Any]]:
    """{(kind, name): object} of every object of the operator's kinds with an owner reference to `owner_uid`."""
    found = {}
    for kind, collection in COLLECTIONS.items():
        for item in kube.request("GET", collection.format(ns=namespace))["items"]:
            refs = item["metadata"].get("ownerReferences") or []
            if any(ref["uid"] == owner_uid for ref in refs):
                found[kind, item["metadata"]["name"]] = item
    return found


def operator_writes(emulator: Any, since: int = 0) -> list[tuple[str, str]]:
    """(method, path) of every write request the operator (its client or kopf) sent, from request `since` on."""
    writes = []
    for request in list(emulator)[since:]:
        method = str(getattr(request.method, "value", request.method)).upper()
        agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
        if method in WRITES and agent.startswith(OPERATOR_AGENTS):
            writes.append((method, str(request.url.path)))
    return writes


def num_requests(emulator: Any) -> int:
    return len(list(emulator))


@contextlib.contextmanager
def running_operator(api: Any, **config: Any) -> Iterator[Any]:
    """A real kopf operator with `config` (handlers.OperatorConfig fields) against the emulator; yields its memo."""
    import kopf

    from hpi_operator.handlers import OperatorConfig, build_registry
    from hpi_operator.kube import KubeClient
    from hpi_operator.op_metrics import OperatorMetrics
    from hpi_testing.kube_emulator import operator_thread

    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    with operator_thread(build_registry(OperatorConfig(**config)), memo=memo):
        yield memo


def reconciles(memo: Any, result: str) -> float:
    """How many reconcile passes of the operator with `memo` ended with `result` (its own metrics)."""
    value = memo.metrics.registry.get_sample_value("hpi_operator_reconciles_total", {"result": result})
    return value or 0.0


def field_owners(obj: dict[str, Any], *path: str) -> set[str]:
    """The field managers that own `path` (e.g. "spec", "replicas") of `obj`, from its managedFields."""
    owners = set()
    for entry in obj["metadata"].get("managedFields") or []:
        node = entry.get("fieldsV1") or {}
        for key in path:
            node = node.get(f"f:{key}") if isinstance(node, dict) else None
        if node is not None:
            owners.add(entry["manager"])
    return owners
