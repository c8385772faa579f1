"""The router's queue as demand: its /metrics page as prometheus_client renders the contracted gauge (as hpi-router
exports it), parsed and summed over flows and router pods; router pods that do not answer or have no queue are
reported and count nothing; and the builtin poll wakes a pool from zero on it with no annotation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import aiohttp.web
import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from hpi_contracts.metrics import (
    PRIORITY_LABEL,
    READ_FROM_ROUTER,
    ROUTER_QUEUED_REQUESTS,
    ROUTER_TENANT_KEYS,
    TENANT_LABEL,
)
from hpi_operator.autoscaling.decision import PodLoad
from hpi_operator.autoscaling.loop import ANNOTATION_WAITING_REQUESTS, external_demand, poll
from hpi_operator.autoscaling.router_queue import (
    RouterQueue,
    parse_router_queued,
    router_status,
    scrape_router_queue,
)
from hpi_operator.autoscaling.scrape import (
    UNPARSABLE,
    UNREACHABLE,
    MetricsParseError,
    PodTarget,
    Scraped,
    ScrapeFailed,
)
from hpi_operator.spec import AutoscalingSpec
from hpi_testing.server import free_port, serve_metrics

ASLEEP = AutoscalingSpec(enabled=True, min_replicas=0, max_replicas=4, scale_to_zero=True,
                         scale_to_zero_idle_s=60, poll_interval_s=15)  # fmt: skip


def router_page(flows: dict[tuple[str, str], float]) -> str:
    """A router's /metrics as prometheus_client renders the gauge: one sample per (tenant, priority) flow, and
    the gauge declared with no sample before any flow was seen."""
    registry = CollectorRegistry()
    gauge = Gauge(ROUTER_QUEUED_REQUESTS, "Requests held in the router's queue.", [TENANT_LABEL, PRIORITY_LABEL],
                  registry=registry)  # fmt: skip
    for (tenant, priority), value in flows.items():
        gauge.labels(tenant, priority).set(value)
    other = Gauge("hpi:router_backends", "Ready backends.", registry=registry)  # other names are ignored
    other.set(7)
    return generate_latest(registry).decode()


def test_the_operator_reads_the_contracted_gauge() -> None:
    assert READ_FROM_ROUTER == (ROUTER_QUEUED_REQUESTS, ROUTER_TENANT_KEYS)


def test_flows_are_summed_and_an_idle_router_holds_nothing() -> None:
    page = router_page({("team-a", "high"): 2, ("team-a", "low"): 3, ("team-b", "high"): 1})
    assert ROUTER_QUEUED_REQUESTS + '{priority="high",tenant="team-a"} 2.0' in page  # the name as-is
    assert parse_router_queued(page) == 6
    assert parse_router_queued(router_page({})) == 0  # declared, no flow yet: idle, not missing


@pytest.mark.parametrize("text, match", [
    ("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n", "no hpi:router_queued_requests"),
    ("", "no hpi:router_queued_requests"),
    ("<html>502 Bad Gateway</html>", "not Prometheus text"),
    (f'{ROUTER_QUEUED_REQUESTS}{{tenant="a",priority="x"}} NaN\n', "finite"),
    (f'{ROUTER_QUEUED_REQUESTS}{{tenant="a",priority="x"}} +Inf\n', "finite"),
    (f'{ROUTER_QUEUED_REQUESTS}{{tenant="a",priority="x"}} 4\n{ROUTER_QUEUED_REQUESTS}{{tenant="b",priority="x"}} -1\n',
     "non-negative"),
], ids=["other-metrics", "empty", "garbage", "nan", "inf", "negative"])  # fmt: skip
def test_a_page_without_a_usable_gauge_is_unparsable(text: str, match: str) -> None:
    with pytest.raises(MetricsParseError, match=match):
        parse_router_queued(text)


@pytest.fixture()
async def serve() -> AsyncIterator[Callable[[str], object]]:
    runners: list[aiohttp.web.AppRunner] = []

    async def start(text: str) -> PodTarget:
        runner, port = await serve_metrics(lambda: text)
        runners.append(runner)
        return PodTarget(f"router-{len(runners)}", f"http://127.0.0.1:{port}/metrics")

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_router_pods_are_summed_and_failures_reported_never_counted(serve) -> None:
    ok_1 = await serve(router_page({("a", "high"): 2, ("b", "low"): 1}))
    ok_2 = await serve(router_page({("a", "high"): 4}))
    stale = await serve("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n")  # no queue
    dead = PodTarget("router-dead", f"http://127.0.0.1:{free_port()}/metrics")
    queue = await scrape_router_queue([ok_1, ok_2, stale, dead], timeout_s=2.0)
    assert queue.num_queued == 7 and queue.num_routers == 4
    assert [(f.pod, f.kind) for f in queue.failed] == [(stale.pod, UNPARSABLE), ("router-dead", UNREACHABLE)]
    status = router_status(queue)
    assert status["routerQueuedRequests"] == 7 and status["numUnreachableRouterPods"] == 2
    assert [f["pod"] for f in status["failedRouterPods"]] == [stale.pod, "router-dead"]
    assert await scrape_router_queue([]) == RouterQueue()
    assert set(router_status(RouterQueue()).values()) == {None}  # no router: the keys are removed


def test_the_annotation_and_the_router_count_the_same_requests() -> None:
    router = RouterQueue(num_queued=3, num_routers=1)
    assert external_demand({ANNOTATION_WAITING_REQUESTS: "2"}, router) == 3
    assert external_demand({ANNOTATION_WAITING_REQUESTS: "5"}, router) == 5
    assert external_demand(None, RouterQueue()) == 0


async def test_a_queue_in_the_router_wakes_a_pool_from_zero_without_the_annotation() -> None:
    asleep = await poll(ASLEEP, 0, {}, {}, [], 0.0, router=RouterQueue(num_routers=1))
    assert asleep.scale_to is None and asleep.status["autoscaling"]["routerQueuedRequests"] == 0
    woken = await poll(ASLEEP, 0, {}, {}, [], 15.0, router=RouterQueue(num_queued=3, num_routers=1))
    assert woken.scale_to == 1
    auto = woken.status["autoscaling"]
    assert auto["lastDecision"]["reason"] == "ScaledFromZero" and auto["routerQueuedRequests"] == 3
    floor = await poll(replace(ASLEEP, min_replicas=2), 0, {}, {}, [], 15.0, router=RouterQueue(3, 1))
    assert floor.scale_to == 2  # max(minReplicas, 1)
    unreadable = RouterQueue(0, 1, (ScrapeFailed("r-0", UNREACHABLE, "connection refused"),))
    blind = await poll(ASLEEP, 0, {}, {}, [], 15.0, router=unreadable)
    assert blind.scale_to is None  # an unreadable router is no demand, only reported
    assert blind.status["autoscaling"]["failedRouterPods"][0]["pod"] == "r-0"


async def test_requests_queued_in_the_router_keep_a_pool_from_scaling_to_zero() -> None:
    """One idle pod (nothing running or waiting in it) for longer than the idle window: zero without a queue in the
    router, one replica kept while the router holds requests (they wait for a backend with room, or a ready one)."""
    async def idle_pod(targets):
        return [Scraped(t.pod, PodLoad(t.pod, 0.0)) for t in targets]

    settings = replace(ASLEEP, scale_down_stabilization_s=0)
    pod = [PodTarget("p0", "http://10.0.0.1:8000/metrics")]

    async def replicas_after(router: RouterQueue) -> int:
        replicas, status = 1, {}
        for i in range(8):  # 8 polls of 15 s: past the 60 s idle window
            result = await poll(settings, replicas, status, {}, pod if replicas else [], 15.0 * i, idle_pod, router)
            status = result.status
            replicas = result.scale_to if result.scale_to is not None else replicas
        return replicas

    assert await replicas_after(RouterQueue(num_routers=1)) == 0
    assert await replicas_after(RouterQueue(num_queued=2, num_routers=1)) == 1


def test_parse_the_routers_own_exposition() -> None:
    """The operator reads what hpi_router's /metrics writes (both sides of the hpi_contracts.metrics contract):
    zero before any request waits, then the sum over the router's flows."""
    router_metrics = pytest.importorskip("hpi_router.metrics", reason="the router package is not installed")
    from hpi_router.queue import Flow

    metrics = router_metrics.RouterMetrics()
    assert parse_router_queued(metrics.render().decode()) == 0
    metrics.queue_changed(Flow("team-a"), 3, None)
    metrics.queue_changed(Flow("team-b", priority=5), 2, None)
    metrics.queue_changed(Flow("team-a"), 2, 0.5)  # one of team-a's left after 0.5 s
    assert parse_router_queued(metrics.render().decode()) == 4
