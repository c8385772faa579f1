"""status.routing.tenantKeys: the count of API keys the router pods loaded, read from their /metrics as hpi-router
renders it (never from the Secret); end to end with the real kopf operator against the API emulator, a router pod
played by a loopback /metrics endpoint: the count appears, follows the routers, and leaves with the Secret."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import kopf
import kubernetes
import pytest

from hpi_operator.autoscaling.scrape import MetricsParseError
from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.manifests import Owner
from hpi_operator.op_metrics import OperatorMetrics
from hpi_operator.routing_manifests import router_name, router_pod_labels
from hpi_operator.tenant_keys import parse_tenant_keys
from hpi_testing.kube_emulator import eventually, make_node, operator_thread
from hpi_testing.kube_emulator import runtime_pod as make_pod
from hpi_testing.server import serve_metrics

router_metrics = pytest.importorskip("hpi_router.metrics", reason="the router package is not installed")

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
MERGE = "application/merge-patch+json"


def test_the_count_is_read_from_the_routers_own_exposition() -> None:
    metrics = router_metrics.RouterMetrics()
    assert parse_tenant_keys(metrics.render().decode()) == 0  # no tenants file
    metrics.tenant_keys.set(3)
    assert parse_tenant_keys(metrics.render().decode()) == 3
    with pytest.raises(MetricsParseError, match="hpi:router_tenant_keys"):
        parse_tenant_keys("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n")


@contextlib.asynccontextmanager
async def running_operator(api: kubernetes.client.ApiClient) -> AsyncIterator[None]:
    """operator_thread entered and left off the event loop, so the emulator on this loop keeps answering."""
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    context = operator_thread(build_registry(OperatorConfig(resync_interval_s=0.5, tenant_keys_interval_s=0.2)),
                              memo=memo)  # fmt: skip
    await asyncio.to_thread(context.__enter__)
    try:
        yield
    finally:
        await asyncio.to_thread(context.__exit__, None, None, None)


async def call(kube: KubeClient, method: str, path: str, body: Any = None, content_type: str = "application/json"):
    return await asyncio.to_thread(kube.request, method, path, body, content_type)


def tenant_keys(kube: KubeClient) -> Any:
    return ((kube.get(f"{CRS}/front").get("status") or {}).get("routing") or {}).get("tenantKeys")


@pytest.mark.slow
async def test_status_shows_the_keys_the_routers_loaded(kube: KubeClient, api: kubernetes.client.ApiClient) -> None:
    await call(kube, "POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    await call(kube, "POST", CRS, {
        "apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "front", "namespace": NS},
        "spec": {"replicas": 1, "routing": {"router": {"tenantsSecretRef": {"name": "team-keys"}}}},
    })  # fmt: skip
    metrics = router_metrics.RouterMetrics()
    metrics.tenant_keys.set(3)
    runner, port = await serve_metrics(lambda: metrics.render().decode())
    try:
        async with running_operator(api):
            pod = make_pod(f"{router_name('front')}-5d9c-x2x", port, router_pod_labels(Owner("front", NS)), NS)
            await call(kube, "POST", f"/api/v1/namespaces/{NS}/pods", pod)
            await eventually(lambda: tenant_keys(kube) == 3)
            metrics.tenant_keys.set(4)  # a key added to the Secret, reloaded by the router
            await eventually(lambda: tenant_keys(kube) == 4)
            await call(kube, "PATCH", f"{CRS}/front", {"spec": {"routing": {"router": {"tenantsSecretRef": None}}}},
                       MERGE)  # fmt: skip
            await eventually(lambda: "routing" not in (kube.get(f"{CRS}/front").get("status") or {}))
    finally:
        await runner.cleanup()
