"""Reading what the operator left on an emulated cluster: the children an InferenceDeployment owns, and the
write requests the operator sent (the emulator logs every request it served)."""

from __future__ import annotations

import asyncio
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
OPERATOR_MANAGERS = ("hpi-operator", "kopf", "hpi-autoscaler")  # the field managers of those agents' writes
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


def reconciles(memo: Any, result: str | None = None) -> float:
    """How many reconcile passes of the operator with `memo` ended with `result`, or at all (its own metrics)."""
    if result is not None:
        value = memo.metrics.registry.get_sample_value("hpi_operator_reconciles_total", {"result": result})
        return value or 0.0
    return sum(sample.value for metric in memo.metrics.registry.collect() for sample in metric.samples
               if sample.name == "hpi_operator_reconciles_total")  # fmt: skip


def autoscaler_polls(memo: Any, namespace: str, name: str) -> float:
    """How many polls the builtin autoscaler of the operator with `memo` made for one InferenceDeployment."""
    labels = {"inference_namespace": namespace, "inference_deployment": name}
    return memo.metrics.registry.get_sample_value("hpi_operator_autoscaler_polls_total", labels) or 0.0


def operator_write_records(emulator: Any, since: int = 0, stored_only: bool = False) -> list[Any]:
    """The emulator's WriteRecords of the operator's requests (its client, kopf and its autoscaler) from
    `emulator.writes[since]` on; `stored_only`: those that changed an object."""
    return [w for w in emulator.writes[since:] if w.manager in OPERATOR_MANAGERS and (w.stored or not stored_only)]


def field_owners(obj: dict[str, Any], *path: str) -> set[str]:
    """The field managers that own `path` (e.g. "spec", "replicas") of `obj`, from its managedFields."""
    owners = set()
    for entry in obj["metadata"].get("managedFields") or []:
        node = entry.get("fieldsV1") or {}
        for key in path:
            segment = key if key.startswith(("k:", "v:")) else f"f:{key}"  # a list item's own segment
            node = node.get(segment) if isinstance(node, dict) else None
        if node is not None:
            owners.add(entry["manager"])
    return owners


class AsyncApi:
    """Async wrappers around a KubeClient for tests that run in the event loop serving the emulator: the sync
    client must not block that loop."""

    MERGE = "application/merge-patch+json"

    def __init__(self, kube: Any) -> None:
        self.kube = kube

    async def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        return await asyncio.to_thread(self.kube.request, method, path, body, content_type)

    async def get(self, path: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.kube.get, path)

    async def patch(self, path: str, body: Any) -> Any:
        return await self.call("PATCH", path, body, self.MERGE)
