"""Scale to sleep end to end: the real kopf operator against the kmock-based API emulator puts an idle pool's pod
to sleep (POST /sleep?level=2) instead of scaling it away, and wakes it (POST /wake_up) when requests queue in the
router; the pod, its Deployment and spec.replicas stay.

The runtime pod is a loopback stand-in (aiohttp) with the runtime's sleep endpoints and /ready semantics (503
while asleep), not a real `hpi serve`: a real one costs a minute of start-up per test on 2 cores, and the real
endpoints are tested against the real engine in tests/runtime/server (sleep frees and restores memory, greedy
output identical after a wake). The test plays the kubelet: it copies the stand-in's /ready into the Pod's Ready
condition, as a readiness probe does, so the operator must find a pod that is not ready to wake it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import aiohttp.web
import kopf
import kubernetes
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from hpi_contracts.metrics import PRIORITY_LABEL, ROUTER_QUEUED_REQUESTS, TENANT_LABEL
from hpi_operator.autoscaling import handlers as autoscaling_handlers
from hpi_operator.autoscaling.scrape import ready_pod_targets
from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.manifests import Owner, common_labels
from hpi_operator.op_metrics import OperatorMetrics
from hpi_operator.routing_manifests import router_name, router_pod_labels
from hpi_testing.cluster_state import autoscaler_polls
from hpi_testing.kube_emulator import eventually, make_node, operator_thread
from hpi_testing.kube_emulator import runtime_pod as make_runtime_pod
from hpi_testing.server import serve_metrics, serving

pytestmark = pytest.mark.slow

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
PODS = f"/api/v1/namespaces/{NS}/pods"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
MERGE = "application/merge-patch+json"


class SleepyRuntime:
    """A runtime pod's HTTP surface as the operator and kubelet use it: /metrics (idle), /ready (503 asleep),
    POST /sleep?level=N and POST /wake_up (vLLM's), each call recorded."""

    def __init__(self) -> None:
        self.sleeping_level = 0
        self.calls: list[str] = []

    def app(self) -> aiohttp.web.Application:
        async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
            text = "".join(f'# TYPE {name} gauge\n{name}{{model_name="m",engine="0"}} 0.0\n' for name in (
                "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running"))  # fmt: skip
            return aiohttp.web.Response(text=text, content_type="text/plain")

        async def ready(_: aiohttp.web.Request) -> aiohttp.web.Response:
            return aiohttp.web.json_response({"ready": not self.sleeping_level}, status=503 if self.sleeping_level
                                             else 200)  # fmt: skip

        async def sleep(request: aiohttp.web.Request) -> aiohttp.web.Response:
            self.calls.append(f"sleep {request.query.get('level', '1')}")
            self.sleeping_level = int(request.query.get("level", "1"))
            return aiohttp.web.json_response({"is_sleeping": True, "level": self.sleeping_level, "freed_bytes": 1})

        async def wake_up(_: aiohttp.web.Request) -> aiohttp.web.Response:
            self.calls.append("wake_up")
            level, self.sleeping_level = self.sleeping_level, 0
            return aiohttp.web.json_response({"is_sleeping": False, "level": level, "restored_bytes": 1})

        app = aiohttp.web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/ready", ready)
        app.router.add_post("/sleep", sleep)
        app.router.add_post("/wake_up", wake_up)
        return app


async def call(kube: KubeClient, method: str, path: str, body: Any = None, content_type: str = "application/json"):
    return await asyncio.to_thread(kube.request, method, path, body, content_type)


async def kubelet(kube: KubeClient, pod: str, port: int) -> None:
    """The readiness probe: the pod's Ready condition follows its /ready, checked every 50 ms."""
    ready_before = True
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"http://127.0.0.1:{port}/ready") as response:
                ready = response.status == 200
            if ready != ready_before:
                condition = {"type": "Ready", "status": "True" if ready else "False"}
                await call(kube, "PATCH", f"{PODS}/{pod}/status", {"status": {"conditions": [condition]}}, MERGE)
                ready_before = ready
            await asyncio.sleep(0.05)


def router_metrics(num_queued: int) -> str:
    registry = CollectorRegistry()
    gauge = Gauge(ROUTER_QUEUED_REQUESTS, "Requests held in the router's queue.", [TENANT_LABEL, PRIORITY_LABEL],
                  registry=registry)  # fmt: skip
    if num_queued:
        gauge.labels("team-a", "high").set(num_queued)
    return generate_latest(registry).decode()


def autoscaling_status(kube: KubeClient, name: str) -> dict[str, Any]:
    return (kube.get(f"{CRS}/{name}").get("status") or {}).get("autoscaling") or {}


def ready_condition(kube: KubeClient, name: str) -> tuple[str, str] | None:
    conditions = (kube.get(f"{CRS}/{name}").get("status") or {}).get("conditions") or []
    return next(((c["status"], c["reason"]) for c in conditions if c["type"] == "Ready"), None)


def event_reasons(kube: KubeClient) -> list[str]:
    return [e["reason"] for e in kube.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]]


@pytest.mark.parametrize("broken", [False, True], ids=["operator", "broken-only-ready-pods-found"])
async def test_an_idle_pool_sleeps_in_place_and_the_routers_queue_wakes_it(
    kube: KubeClient, api: kubernetes.client.ApiClient, monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    if broken:  # the pod index as the scaler had it: ready pods only, so a sleeping pod is never found again
        monkeypatch.setattr(autoscaling_handlers, "running_pod_targets", ready_pod_targets)
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    registry = build_registry(OperatorConfig(resync_interval_s=0.5, autoscale_tick_s=0.2))
    await call(kube, "POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    cr = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
          "metadata": {"name": "nap", "namespace": NS},
          "spec": {"replicas": 1, "routing": {"mode": "router"}, "autoscaling": {
              "enabled": True, "minReplicas": 0, "maxReplicas": 2, "pollIntervalSeconds": 1,
              "scaleToZero": {"enabled": True, "idleSeconds": 1, "sleepLevel": 2}}}}  # fmt: skip
    runtime, num_queued = SleepyRuntime(), [0]
    context = operator_thread(registry, memo=memo)
    await asyncio.to_thread(context.__enter__)
    router_runner, router_port = await serve_metrics(lambda: router_metrics(num_queued[0]))
    try:
        async with serving(runtime.app()) as port:
            await call(kube, "POST", CRS, cr)
            labels = {**common_labels("nap"), "serving.hpi.dev/pool": "p"}
            await call(kube, "POST", PODS, make_runtime_pod("nap-0", port, labels, NS))
            await call(kube, "POST", PODS, make_runtime_pod(f"{router_name('nap')}-0", router_port,
                                                            router_pod_labels(Owner("nap", NS)), NS))  # fmt: skip
            probe = asyncio.create_task(kubelet(kube, "nap-0", port))
            try:
                # Idle for idleSeconds: asleep at level 2, in place.
                auto = await eventually(lambda: (a := autoscaling_status(kube, "nap")).get("sleep") and a)
                assert auto["sleep"]["pods"] == ["nap-0"] and auto["sleep"]["level"] == 2
                assert runtime.calls == ["sleep 2"]
                body = await call(kube, "GET", f"{CRS}/nap")
                assert body["spec"]["replicas"] == 1, "the pods stay: not scaled to zero"
                await eventually(lambda: kube.get(f"{PODS}/nap-0")["status"]["conditions"][0]["status"] == "False")
                assert "ScaledToSleep" in await asyncio.to_thread(event_reasons, kube)
                await eventually(lambda: ready_condition(kube, "nap") == ("True", "Sleeping"))  # by design, not a fault

                # Requests queue in the router: the sleeping (not ready) pod is found and woken.
                num_queued[0] = 2

                def woken() -> bool:
                    assert runtime.calls == ["sleep 2", "wake_up"], "not woken"
                    return True

                if broken:
                    await eventually(lambda: autoscaling_status(kube, "nap").get("routerQueuedRequests") == 2)
                    polls = autoscaler_polls(memo, NS, "nap")
                    await eventually(lambda: autoscaler_polls(memo, NS, "nap") >= polls + 3)
                    with pytest.raises(AssertionError, match="not woken"):
                        woken()
                    return
                await eventually(woken)
                await eventually(lambda: "sleep" not in autoscaling_status(kube, "nap"))
                await eventually(lambda: kube.get(f"{PODS}/nap-0")["status"]["conditions"][0]["status"] == "True")
                assert (await call(kube, "GET", f"{CRS}/nap"))["spec"]["replicas"] == 1
                assert "WokeUp" in await asyncio.to_thread(event_reasons, kube)
            finally:
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probe
    finally:
        await router_runner.cleanup()
        await asyncio.to_thread(context.__exit__, None, None, None)
