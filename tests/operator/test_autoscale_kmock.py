"""The builtin autoscaler end to end: the real kopf operator against the kmock-based API emulator, runtime pods
played by Pod objects whose /metrics are small aiohttp servers on loopback ports serving vLLM-format text
with values the test controls. KV above target scales the InferenceDeployment up; below target, after the
window, down; an unreachable pod holds the scale-down; a restarted operator keeps the window."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import kopf
import kubernetes
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from hpi_contracts.metrics import PRIORITY_LABEL, ROUTER_QUEUED_REQUESTS, TENANT_LABEL
from hpi_operator import rbac
from hpi_operator.autoscaling import handlers as autoscaling_handlers
from hpi_operator.autoscaling import loop as autoscaling_loop
from hpi_operator.autoscaling.decision import History, decide
from hpi_operator.autoscaling.router_queue import RouterQueue
from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.manifests import Owner, common_labels
from hpi_operator.names import AUTOSCALER_FIELD_MANAGER, FIELD_MANAGER
from hpi_operator.op_metrics import OperatorMetrics
from hpi_operator.routing_manifests import router_name, router_pod_labels
from hpi_testing.cluster_state import autoscaler_polls, field_owners, operator_writes
from hpi_testing.kube_emulator import eventually, make_node, operator_thread
from hpi_testing.kube_emulator import runtime_pod as make_runtime_pod
from hpi_testing.server import serve_metrics

pytestmark = pytest.mark.slow

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
PODS = f"/api/v1/namespaces/{NS}/pods"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
MERGE = "application/merge-patch+json"
WINDOW_S = 3


class FakeRuntime:
    """One loopback /metrics endpoint per fake pod, serving vLLM's text with a KV value the test sets."""

    def __init__(self) -> None:
        self.kv: dict[str, float] = {}
        self.ports: dict[str, int] = {}
        self.runners: dict[str, aiohttp.web.AppRunner] = {}

    async def start(self, pod: str, kv: float) -> int:
        self.kv[pod] = kv

        def render() -> str:
            kv = self.kv[pod]
            running = 4 if kv > 0.01 else 0
            return (
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{model_name="m",engine="0"}} {kv}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                'vllm:num_requests_waiting{model_name="m",engine="0"} 0.0\n'
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="m",engine="0"}} {running}\n'
            )

        self.runners[pod], self.ports[pod] = await serve_metrics(render)
        return self.ports[pod]

    async def stop(self, pod: str) -> None:
        await self.runners.pop(pod).cleanup()

    async def close(self) -> None:
        for pod in list(self.runners):
            await self.stop(pod)


@pytest.fixture()
async def runtime() -> AsyncIterator[FakeRuntime]:
    fake = FakeRuntime()
    yield fake
    await fake.close()


def make_registry() -> kopf.OperatorRegistry:
    return build_registry(OperatorConfig(resync_interval_s=0.5, autoscale_tick_s=0.2))


@contextlib.asynccontextmanager
async def running_operator(api: kubernetes.client.ApiClient) -> AsyncIterator[kopf.Memo]:
    """operator_thread, entered and left off the event loop: the emulator on this loop keeps answering the
    operator's in-flight requests while it stops (a blocking join here would stall them until its timeout).
    Yields the operator's memo (its metrics count the autoscaler's polls)."""
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    context = operator_thread(make_registry(), memo=memo)
    await asyncio.to_thread(context.__enter__)
    try:
        yield memo
    finally:
        await asyncio.to_thread(context.__exit__, None, None, None)


@pytest.fixture()
async def autoscaling_operator(api: kubernetes.client.ApiClient) -> AsyncIterator[kopf.Memo]:
    async with running_operator(api) as memo:
        yield memo


def runtime_pod(owner: str, name: str, port: int) -> dict[str, Any]:
    return make_runtime_pod(name, port, {**common_labels(owner), "serving.hpi.dev/pool": "p"}, NS)


def autoscaled_cr(name: str, window_s: int = WINDOW_S) -> dict[str, Any]:
    return {
        "apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": 1, "autoscaling": {
            "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetKVUtilization": 0.5,
            "scaleDownStabilizationSeconds": window_s, "maxScaleStep": 2, "pollIntervalSeconds": 1,
        }},
    }  # fmt: skip


async def call(kube: KubeClient, method: str, path: str, body: Any = None, content_type: str = "application/json"):
    return await asyncio.to_thread(kube.request, method, path, body, content_type)


def replicas_of(kube: KubeClient, name: str) -> int:
    return kube.get(f"{CRS}/{name}")["spec"]["replicas"]


def autoscaling_status(kube: KubeClient, name: str) -> dict[str, Any]:
    return (kube.get(f"{CRS}/{name}").get("status") or {}).get("autoscaling") or {}


def deployment_replicas(kube: KubeClient, name: str) -> int:
    runtime = f"serving.hpi.dev/inference-deployment={name},app.kubernetes.io/component=inference"  # not the router
    listing = kube.request("GET", f"{DEPLOYMENTS}?labelSelector={runtime}")
    return sum(d["spec"]["replicas"] for d in listing["items"])


def decide_ignoring_unreadable_pods(settings: Any, current: int, obs: Any, history: Any, now_s: float) -> Any:
    """A deliberately wrong scaler: an unreadable pod counts as no pod, so the low load of the others decides."""
    return decide(settings, current, dataclasses.replace(obs, num_failed=0), history, now_s)


@pytest.mark.parametrize("broken", [False, True], ids=["operator", "broken-unreadable-pod-ignored"])
async def test_kv_above_target_scales_up_and_below_target_scales_down(
    kube: KubeClient, runtime: FakeRuntime, autoscaling_operator: Any, emulator: Any,
    monkeypatch: pytest.MonkeyPatch, broken: bool,
) -> None:  # fmt: skip
    for i in range(4):
        await call(kube, "POST", "/api/v1/nodes", make_node(f"cpu-{i}", bf16=True))
    await call(kube, "POST", CRS, autoscaled_cr("scaly"))
    await call(kube, "POST", PODS, runtime_pod("scaly", "scaly-0", await runtime.start("scaly-0", 0.45)))

    # Within the tolerance of 0.5: the scaler polls, reports, and leaves replicas alone.
    body = await eventually(lambda: (b := kube.get(f"{CRS}/scaly")).get("status", {}).get("kvCacheUtilization")
                            == 0.45 and b)  # fmt: skip
    assert body["spec"]["replicas"] == 1
    assert body["status"]["autoscaling"]["lastDecision"]["reason"] == "Steady"

    # 0.95 on one pod with a target of 0.5: saturated -> ready (1) + step (2) = 3.
    runtime.kv["scaly-0"] = 0.95
    await eventually(lambda: replicas_of(kube, "scaly") == 3)
    await eventually(lambda: deployment_replicas(kube, "scaly") == 3)  # the reconciler spread them
    # Two writers of replicas that never fight: the autoscaler owns the resource's spec.replicas (through the scale
    # subresource, as an HPA), the operator each Deployment's (server-side apply); neither writes the other's.
    assert field_owners(await call(kube, "GET", f"{CRS}/scaly"), "spec", "replicas") == {AUTOSCALER_FIELD_MANAGER}
    listing = await call(kube, "GET", f"{DEPLOYMENTS}?labelSelector=serving.hpi.dev/inference-deployment=scaly")
    assert listing["items"] and all(field_owners(d, "spec", "replicas") == {FIELD_MANAGER} for d in listing["items"])
    scale_writes = [w for w in operator_writes(emulator) if w[1].endswith("/inferencedeployments/scaly/scale")]
    assert scale_writes and rbac.allowed("serving.hpi.dev", "inferencedeployments/scale", "patch")
    # kopf writes spec and status in two requests: the status of the scaling poll follows shortly.
    auto = await eventually(lambda: (a := autoscaling_status(kube, "scaly")).get("lastScaleTime") and a)
    assert auto["windowMax"] and auto["lastDecision"]["reason"] in ("ScaledUp", "Steady")
    events = (await call(kube, "GET", f"/api/v1/namespaces/{NS}/events"))["items"]
    assert any(e["reason"] == "ScaledUp" and e["involvedObject"]["name"] == "scaly" for e in events)

    # The new pods come up at the target (nothing moves); one of them never answers on /metrics.
    runtime.kv["scaly-0"] = 0.5
    await eventually(lambda: kube.get(f"{CRS}/scaly").get("status", {}).get("kvCacheUtilization") == 0.5)
    dead_port = await runtime.start("scaly-2", 0.5)
    await runtime.stop("scaly-2")
    await call(kube, "POST", PODS, runtime_pod("scaly", "scaly-2", dead_port))
    await call(kube, "POST", PODS, runtime_pod("scaly", "scaly-1", await runtime.start("scaly-1", 0.5)))
    await eventually(lambda: autoscaling_status(kube, "scaly").get("numReadyPods") == 3)
    runtime.kv["scaly-0"] = runtime.kv["scaly-1"] = 0.1

    # Load is gone, but one pod is unreadable: no scale-down, however long the window has passed.
    await eventually(lambda: autoscaling_status(kube, "scaly").get("numUnreachablePods") == 1)
    if broken:
        monkeypatch.setattr(autoscaling_loop, "decide", decide_ignoring_unreadable_pods)

    # The window has passed once a poll finds that only the unreadable pod stops a scale-down (or one happened).
    await eventually(
        lambda: (
            replicas_of(kube, "scaly") < 3
            or "scale-down blocked" in autoscaling_status(kube, "scaly")["lastDecision"]["message"]
        )
    )

    def held() -> None:
        assert replicas_of(kube, "scaly") == 3, "scaled down"
        auto = autoscaling_status(kube, "scaly")
        assert auto["lastDecision"]["reason"] == "MetricsMissing"
        assert auto["failedPods"][0]["pod"] == "scaly-2" and auto["failedPods"][0]["kind"] == "unreachable"

    if broken:
        with pytest.raises(AssertionError, match="scaled down"):
            await asyncio.to_thread(held)
        return
    await asyncio.to_thread(held)
    events = (await call(kube, "GET", f"/api/v1/namespaces/{NS}/events"))["items"]
    assert any(e["reason"] == "MetricsUnavailable" for e in events)

    # The unreadable pod goes away: now the low load scales down, to the minimum.
    await call(kube, "DELETE", f"{PODS}/scaly-2")
    await eventually(lambda: replicas_of(kube, "scaly") == 1, timeout_s=30)
    await eventually(lambda: deployment_replicas(kube, "scaly") == 1)
    auto = await asyncio.to_thread(autoscaling_status, kube, "scaly")
    assert auto["lastDecision"]["reason"] in ("ScaledDown", "Steady") and auto["numUnreachablePods"] == 0


class Clock:
    """The autoscaler's wall clock, moved on by the test: a window passes when the test says, not when a
    loaded machine gets there."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def time(self) -> float:
        return time.time() + self.offset_s


@pytest.mark.parametrize("broken", [False, True], ids=["operator", "broken-memory-in-process"])
async def test_a_restarted_operator_keeps_the_scale_down_window(
    kube: KubeClient, runtime: FakeRuntime, api: kubernetes.client.ApiClient, monkeypatch: pytest.MonkeyPatch,
    broken: bool,
) -> None:  # fmt: skip
    clock = Clock()
    monkeypatch.setattr(autoscaling_handlers, "time", clock)
    for i in range(2):
        await call(kube, "POST", "/api/v1/nodes", make_node(f"cpu-{i}", bf16=True))
    window_s = 600  # never over on its own within the test: only the clock's jump below ends it
    async with running_operator(api):
        await call(kube, "POST", CRS, autoscaled_cr("keep", window_s))
        await call(kube, "POST", PODS, runtime_pod("keep", "keep-0", await runtime.start("keep-0", 0.8)))
        await eventually(lambda: replicas_of(kube, "keep") == 2)  # ceil(0.8 / 0.5)
        await eventually(lambda: deployment_replicas(kube, "keep") == 2)  # the reconciler is done: stop quietly
        await eventually(lambda: (b := kube.get(f"{CRS}/keep")).get("status", {}).get("observedGeneration")
                         == b["metadata"]["generation"])  # fmt: skip
    # The operator is gone; load drops while nobody watches.
    await call(kube, "POST", PODS, runtime_pod("keep", "keep-1", await runtime.start("keep-1", 0.05)))
    runtime.kv["keep-0"] = 0.05
    scaled_at = (await asyncio.to_thread(autoscaling_status, kube, "keep"))["lastScaleUpEpoch"]
    if broken:  # a scaler that keeps its windows in process memory: a new process starts with none
        monkeypatch.setattr(autoscaling_loop, "history_from_status", lambda status: History())

    restarted_at = clock.time()
    async with running_operator(api):
        # The new process has no memory of its own: only the window on the resource stops a scale-down now.
        first = await eventually(lambda: (a := autoscaling_status(kube, "keep")).get("lastPollEpoch", 0) > restarted_at
                                 and a)  # fmt: skip
        assert first["lastPollEpoch"] < scaled_at + window_s  # the restarted scaler's first poll: inside the window

        def held() -> None:
            assert replicas_of(kube, "keep") == 2, "scaled down inside the window"
            assert "held" in autoscaling_status(kube, "keep")["lastDecision"]["message"]

        if broken:
            with pytest.raises(AssertionError, match="scaled down inside the window"):
                await asyncio.to_thread(held)
            return
        await asyncio.to_thread(held)
        clock.offset_s = window_s  # the window is over
        await eventually(lambda: replicas_of(kube, "keep") == 1, timeout_s=30)
        # spec.replicas and the status are two writes (status is a subresource): wait for the scale's record.
        await eventually(lambda: autoscaling_status(kube, "keep").get("lastScaleEpoch") != scaled_at)
        auto = await asyncio.to_thread(autoscaling_status, kube, "keep")
        assert auto["lastScaleEpoch"] >= scaled_at + window_s  # not before the window that began before restart


@pytest.mark.parametrize("broken", [False, True], ids=["operator", "broken-timer-for-every-mode"])
async def test_hpa_mode_renders_an_owned_hpa_and_a_mode_change_removes_it(
    kube: KubeClient, autoscaling_operator: kopf.Memo, monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    memo = autoscaling_operator
    if broken:  # the builtin scaler's timer started whatever the mode: it would fight the HPA
        monkeypatch.setattr(autoscaling_handlers, "builtin_active", lambda settings: settings.enabled)
    hpa_path = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/ext"
    await call(kube, "POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    created = await call(
        kube,
        "POST",
        CRS,
        {
            **autoscaled_cr("ext"),
            "spec": {
                "replicas": 2,
                "autoscaling": {
                    "enabled": True,
                    "mode": "hpa",
                    "minReplicas": 1,
                    "maxReplicas": 5,
                    "targetKVUtilization": 0.6,
                },
            },
        },
    )
    hpa = await eventually(lambda: kube.get(hpa_path))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
                                             "name": "ext"}  # fmt: skip
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "600m"
    [ref] = hpa["metadata"]["ownerReferences"]
    assert ref["uid"] == created["metadata"]["uid"] and ref["controller"] is True
    # No builtin timer for an hpa-mode resource: while the scaler polls a builtin-mode resource created after it
    # twice, it never polls this one and nothing writes its status.autoscaling.
    await call(kube, "POST", CRS, autoscaled_cr("builtin"))
    await eventually(lambda: autoscaler_polls(memo, NS, "builtin") >= 2)

    def never_polled() -> None:
        assert autoscaler_polls(memo, NS, "ext") == 0, "polled"
        assert not autoscaling_status(kube, "ext")

    if broken:
        with pytest.raises(AssertionError, match="polled"):
            await asyncio.to_thread(never_polled)
        return
    await asyncio.to_thread(never_polled)
    # Back to builtin: the HPA goes (it would fight the builtin scaler otherwise), and the timer starts.
    await call(kube, "PATCH", f"{CRS}/ext", {"spec": {"autoscaling": {"mode": "builtin"}}}, MERGE)
    await eventually(lambda: kube.get(hpa_path) is None)
    await eventually(lambda: autoscaling_status(kube, "ext").get("lastDecision"))


def router_metrics(queued: dict[tuple[str, str], float]) -> str:
    """hpi-router's queue gauge as prometheus_client renders it: one sample per (tenant, priority) flow."""
    registry = CollectorRegistry()
    gauge = Gauge(ROUTER_QUEUED_REQUESTS, "Requests held in the router's queue.", [TENANT_LABEL, PRIORITY_LABEL],
                  registry=registry)  # fmt: skip
    for (tenant, priority), value in queued.items():
        gauge.labels(tenant, priority).set(value)
    return generate_latest(registry).decode()


@pytest.mark.parametrize("broken", [False, True], ids=["operator", "broken-router-not-scraped"])
async def test_requests_queued_in_the_router_wake_a_pool_from_zero_without_an_annotation(
    kube: KubeClient, autoscaling_operator: kopf.Memo, monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    memo = autoscaling_operator
    if broken:  # the scaler as it was: only the annotation wakes a pool at zero
        async def no_router(*_: Any, **__: Any) -> RouterQueue:
            return RouterQueue()

        monkeypatch.setattr(autoscaling_handlers, "scrape_router_queue", no_router)
    await call(kube, "POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    cr = autoscaled_cr("sleepy")
    cr["spec"]["replicas"] = 0
    cr["spec"]["routing"] = {"mode": "router"}
    cr["spec"]["autoscaling"].update(minReplicas=0, scaleToZero={"enabled": True, "idleSeconds": 600})
    await call(kube, "POST", CRS, cr)
    # Asleep: the scaler polls and leaves it at zero; the reconciler runs the router's Deployment, no runtime pod.
    await eventually(lambda: autoscaling_status(kube, "sleepy").get("lastDecision"))
    await eventually(lambda: kube.get(f"{DEPLOYMENTS}/{router_name('sleepy')}"))
    assert await asyncio.to_thread(replicas_of, kube, "sleepy") == 0
    assert await asyncio.to_thread(deployment_replicas, kube, "sleepy") == 0

    # A router pod, as the router's Deployment runs it, holding three requests over two flows for a backend.
    runner, port = await serve_metrics(lambda: router_metrics({("team-a", "high"): 2, ("team-b", "low"): 1}))
    try:
        labels = router_pod_labels(Owner("sleepy", NS))
        await call(kube, "POST", PODS, make_runtime_pod(f"{router_name('sleepy')}-5d9c-x2x", port, labels, NS))
        polls_before = autoscaler_polls(memo, NS, "sleepy")

        def woken() -> bool:
            assert replicas_of(kube, "sleepy") == 1, "stayed at zero"
            return True

        if broken:
            await eventually(lambda: autoscaler_polls(memo, NS, "sleepy") >= polls_before + 3)
            with pytest.raises(AssertionError, match="stayed at zero"):
                await asyncio.to_thread(woken)
            return
        await eventually(woken)
        await eventually(lambda: deployment_replicas(kube, "sleepy") == 1)  # the reconciler ran it
        auto = await eventually(lambda: (a := autoscaling_status(kube, "sleepy")).get("routerQueuedRequests") == 3
                                and a)  # fmt: skip
        assert auto["numRouterPods"] == 1 and auto["numUnreachableRouterPods"] == 0
        body = await call(kube, "GET", f"{CRS}/sleepy")
        assert autoscaling_loop.ANNOTATION_WAITING_REQUESTS not in (body["metadata"].get("annotations") or {})
        events = (await call(kube, "GET", f"/api/v1/namespaces/{NS}/events"))["items"]
        assert any(e["reason"] == "ScaledFromZero" and e["involvedObject"]["name"] == "sleepy" for e in events)
    finally:
        await runner.cleanup()
