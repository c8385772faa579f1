"""The same operator against a real cluster (KUBECONFIG): what the emulator cannot show — real garbage
collection through owner references, server-side defaulting that must not cause write churn, the real
server-side apply (managed fields, a deleted child recreated), real label selectors and the CRD's structural
schema (pruning, defaults, the scale subresource).

Runs only when KUBECONFIG points at a reachable cluster (marker `cluster`); it creates a namespace of its
own and, if absent, the CRD; it needs at least one Ready, schedulable node.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import kubernetes
import pytest
import yaml

from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient, KubeError
from hpi_operator.op_metrics import OperatorMetrics
from hpi_testing.kube_emulator import eventually, operator_thread

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
CRD = Path(__file__).resolve().parents[2] / "crds" / "inferencedeployments.serving.hpi.dev.yaml"


@pytest.fixture()
def cluster() -> Iterator[tuple[KubeClient, str]]:
    api = kubernetes.config.new_client_from_config()
    kube = KubeClient(api, user_agent="hpi-tests")
    crd = yaml.safe_load(CRD.read_text())
    if kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}") is None:
        kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        time.sleep(3)  # the API server starts serving a new CRD asynchronously
    namespace = f"hpi-test-{uuid.uuid4().hex[:6]}"
    manifest = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    kube.request("POST", "/api/v1/namespaces", manifest)
    try:
        yield kube, namespace
    finally:
        kube.request("DELETE", f"/api/v1/namespaces/{namespace}")
        api.close()


async def test_real_cluster_gc_defaults_and_scale(cluster: tuple[KubeClient, str]) -> None:
    kube, namespace = cluster
    crs = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{namespace}/inferencedeployments"
    deployments = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    memo = kopf.Memo(kube=KubeClient(kube.api), metrics=OperatorMetrics())
    with operator_thread(build_registry(OperatorConfig(resync_interval_s=1)), memo=memo):
        body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
                "metadata": {"name": "smoke"}, "spec": {"replicas": 0}}  # fmt: skip
        created = await asyncio.to_thread(kube.request, "POST", crs, body)
        assert created["spec"]["engine"]["maxModelLen"] == 4096  # CRD defaulting

        def children() -> list[dict[str, Any]]:
            listing = kube.request("GET", f"{deployments}?labelSelector=serving.hpi.dev/inference-deployment=smoke")
            return listing["items"]

        found = await eventually(children, timeout_s=60)
        versions = {d["metadata"]["name"]: d["metadata"]["resourceVersion"] for d in found}
        await asyncio.sleep(5)  # several resyncs: server-side defaults must not make the operator rewrite
        again = await asyncio.to_thread(children)
        assert {d["metadata"]["name"]: d["metadata"]["resourceVersion"] for d in again} == versions

        # Server-side apply: the operator's fields are its own, and a deleted child comes back on its own event.
        managers = {e["manager"]: e["operation"] for e in again[0]["metadata"].get("managedFields") or []}
        assert managers.get("hpi-operator") == "Apply", managers
        service = f"/api/v1/namespaces/{namespace}/services/smoke"
        service_uid = (await asyncio.to_thread(kube.get, service))["metadata"]["uid"]
        await asyncio.to_thread(kube.request, "DELETE", service)
        await eventually(lambda: (s := kube.get(service)) and s["metadata"]["uid"] != service_uid, timeout_s=30)

        # The scale subresource: what `kubectl scale` and an HPA use.
        scale = await asyncio.to_thread(kube.request, "GET", f"{crs}/smoke/scale")
        assert scale["status"]["selector"] == "serving.hpi.dev/inference-deployment=smoke"

        await asyncio.to_thread(kube.request, "DELETE", f"{crs}/smoke")
        await eventually(lambda: kube.get(f"{crs}/smoke") is None, timeout_s=60)
        await eventually(lambda: children() == [], timeout_s=60)  # garbage collection via ownerReferences
    with pytest.raises(KubeError):
        kube.request("GET", f"{crs}/smoke")
