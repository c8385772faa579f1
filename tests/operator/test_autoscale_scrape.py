"""Scraping runtime pods: real aiohttp servers on loopback ports serving Prometheus text as vLLM writes it,
plus a pod that serves garbage and one that does not answer at all."""

from __future__ import annotations

import math
import socket
from collections.abc import AsyncIterator, Callable

import aiohttp.web
import pytest

from hpi_contracts.metrics import KV_CACHE_USAGE, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from hpi_operator.autoscaling.decision import PodLoad
from hpi_operator.autoscaling.scrape import (
    UNPARSABLE,
    UNREACHABLE,
    MetricsParseError,
    PodTarget,
    Scraped,
    ScrapeFailed,
    cold_start_s,
    observation,
    parse_load,
    ready_pod_targets,
    scrape_pods,
    startup_by_pool,
)


def vllm_metrics(kv: float, waiting: float = 0, running: float = 0, model: str = "llama") -> str:
    """The shape of a vLLM (v0.10+) /metrics page: HELP/TYPE lines, model_name and engine labels, counters."""
    labels = f'engine="0",model_name="{model}"'
    return f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{labels}}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{labels}}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{labels}}} {kv}
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{labels}}} 3.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{{labels},le="0.1"}} 5.0
vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} 7.0
vllm:time_to_first_token_seconds_count{{{labels}}} 7.0
vllm:time_to_first_token_seconds_sum{{{labels}}} 0.9
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
async def serve() -> AsyncIterator[Callable[..., object]]:
    runners: list[aiohttp.web.AppRunner] = []

    async def start(body: str, status: int = 200, content_type: str = "text/plain") -> str:
        async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
            return aiohttp.web.Response(text=body, status=status, content_type=content_type)

        app = aiohttp.web.Application()
        app.router.add_get("/metrics", metrics)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}/metrics"

    yield start
    for runner in runners:
        await runner.cleanup()


def test_parse_vllm_text() -> None:
    load = parse_load("p", vllm_metrics(0.42, waiting=3, running=7))
    assert load == PodLoad("p", 0.42, 3.0, 7.0, ttft_buckets=((0.1, 5.0), (math.inf, 7.0)))


def test_parse_runtime_text_uses_only_the_shared_names() -> None:
    # Exactly the names the runtime exports (hpi_contracts.metrics): a rename on either side fails here.
    text = f"{KV_CACHE_USAGE}{{model_name=\"m\"}} 0.5\n{NUM_REQUESTS_WAITING}{{model_name=\"m\"}} 1\n" \
           f"{NUM_REQUESTS_RUNNING}{{model_name=\"m\"}} 2\n"  # fmt: skip
    assert parse_load("p", text) == PodLoad("p", 0.5, 1.0, 2.0)


def test_parse_several_engines_and_other_models() -> None:
    text = vllm_metrics(0.2, 1, 2, model="a") + vllm_metrics(0.6, 3, 4, model="a").replace('engine="0"', 'engine="1"')
    # two engines' TTFT buckets add up bound by bound
    assert parse_load("p", text) == PodLoad("p", pytest.approx(0.4), 4.0, 6.0,
                                            ttft_buckets=((0.1, 10.0), (math.inf, 14.0)))  # fmt: skip
    other = vllm_metrics(0.9, model="b")
    assert parse_load("p", text + other.replace("# ", "#x "), model_name="a").kv_utilization == pytest.approx(0.4)


@pytest.mark.parametrize("text", [
    "",  # empty page
    "vllm:num_requests_waiting 0\n",  # no KV gauge
    "vllm:kv_cache_usage_perc{model_name=\"m\"} NaN\n",
    "vllm:kv_cache_usage_perc 1.7\n",  # not a fraction
    "<html>502 Bad Gateway</html>",
    "vllm:kv_cache_usage_perc{model_name=\"m\" 0.5\n",  # broken label set
])  # fmt: skip
def test_parse_rejects_what_is_not_a_load(text: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_load("p", text)


async def test_scrape_real_servers_incl_an_unparsable_and_an_unreachable_pod(serve) -> None:
    good = [await serve(vllm_metrics(0.8, waiting=2, running=9)), await serve(vllm_metrics(0.1, running=1))]
    garbage = await serve("<html>oops</html>", content_type="text/html")
    erroring = await serve("internal error", status=500)
    dead = f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens there
    targets = [PodTarget("a", good[0]), PodTarget("b", good[1]), PodTarget("c", garbage),
               PodTarget("d", dead), PodTarget("e", erroring)]  # fmt: skip
    results = await scrape_pods(targets, timeout_s=2.0)
    assert [r.pod for r in results] == ["a", "b", "c", "d", "e"]
    ttft = ((0.1, 5.0), (math.inf, 7.0))
    assert results[0] == Scraped("a", PodLoad("a", 0.8, 2.0, 9.0, ttft_buckets=ttft))
    assert results[1] == Scraped("b", PodLoad("b", 0.1, 0.0, 1.0, ttft_buckets=ttft))
    assert isinstance(results[2], ScrapeFailed) and results[2].kind == UNPARSABLE
    assert isinstance(results[3], ScrapeFailed) and results[3].kind == UNREACHABLE
    assert isinstance(results[4], ScrapeFailed) and "500" in results[4].detail
    obs = observation(results)
    assert obs.num_failed == 3 and obs.num_ready == 5 and obs.mean_kv_utilization == pytest.approx(0.45)


async def test_scrape_times_out_on_a_pod_that_hangs() -> None:
    import asyncio

    release = asyncio.Event()

    async def hang(_: aiohttp.web.Request) -> aiohttp.web.Response:
        await asyncio.wait_for(release.wait(), 30)
        return aiohttp.web.Response(text="")

    app = aiohttp.web.Application()
    app.router.add_get("/metrics", hang)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        [result] = await scrape_pods([PodTarget("slow", f"http://127.0.0.1:{port}/metrics")], timeout_s=0.3)
        assert isinstance(result, ScrapeFailed) and result.kind == UNREACHABLE
        assert loop.time() - started < 5
    finally:
        release.set()
        await runner.cleanup()


def pod(name: str, *, ready: bool = True, phase: str = "Running", ip: str | None = "10.0.0.5",
        port: int | None = 8000, deleting: bool = False) -> dict:  # fmt: skip
    container = {"name": "runtime", "ports": [{"name": "http", "containerPort": port}] if port else []}
    meta: dict = {"name": name, "annotations": {"prometheus.io/port": "9100"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "spec": {"containers": [container]}, "status": status}


def test_ready_pod_targets() -> None:
    pods = [
        pod("b"), pod("a", port=None), pod("starting", ready=False), pod("pending", phase="Pending"),
        pod("no-ip", ip=None), pod("leaving", deleting=True), pod("v6", ip="fd00::7"),
    ]  # fmt: skip
    targets = ready_pod_targets(pods)
    assert targets == [
        PodTarget("a", "http://10.0.0.5:9100/metrics"),  # no named port: the Prometheus annotation
        PodTarget("b", "http://10.0.0.5:8000/metrics"),
        PodTarget("v6", "http://[fd00::7]:8000/metrics"),
    ]


def started(name: str, pool: str, created: str, ready_at: str, restarts: int = 0) -> dict:
    body = pod(name)
    body["metadata"] |= {"creationTimestamp": created, "labels": {"serving.hpi.dev/pool": pool}}
    body["status"]["conditions"][0]["lastTransitionTime"] = ready_at
    body["status"]["containerStatuses"] = [{"name": "runtime", "restartCount": restarts}]
    return body


def test_a_ready_pods_pool_and_start_time_come_with_its_target() -> None:
    """The fleet optimizer's lead time is its pools' start times: creation to Ready, never a restart's recovery."""
    fresh = started("fresh", "l4", "2026-12-01T10:00:00Z", "2026-12-01T10:02:05Z")
    restarted = started("restarted", "l4", "2026-12-01T10:00:00Z", "2026-12-01T11:00:00Z", restarts=1)
    clockless = started("clockless", "h200", "not a time", "2026-12-01T10:02:05Z")
    backwards = started("backwards", "h200", "2026-12-01T10:05:00Z", "2026-12-01T10:00:00Z")
    by_name = {t.pod: t for t in ready_pod_targets([fresh, restarted, clockless, backwards, pod("unlabelled")])}
    assert by_name["fresh"].pool == "l4" and by_name["fresh"].start_s == 125.0
    assert cold_start_s(fresh) == 125.0
    assert by_name["restarted"].pool == "l4" and by_name["restarted"].start_s is None
    assert by_name["clockless"].start_s is None and by_name["backwards"].start_s is None
    assert by_name["unlabelled"].pool is None and by_name["unlabelled"].start_s is None


def test_startup_phases_are_read_per_pod_and_summed_up_per_pool() -> None:
    def exposition(total: float, load: float) -> str:
        return (vllm_metrics(0.1) + f'hpi:startup_phase_seconds{{phase="load"}} {load}\n'
                'hpi:startup_phase_seconds{phase="compile"} 9\nhpi:startup_phase_seconds{phase="bad"} NaN\n'
                f"hpi:startup_seconds {total}\n")  # fmt: skip

    fast, slow = parse_load("fast", exposition(20, 1.5)), parse_load("slow", exposition(31, 4))
    assert dict(fast.startup_phases) == {"load": 1.5, "compile": 9.0} and fast.startup_s == 20  # NaN dropped
    bare = parse_load("bare", vllm_metrics(0.1))
    assert bare.startup_phases == () and bare.startup_s is None  # an older runtime: nothing, never a failure
    targets = [PodTarget("fast", "u", "l4"), PodTarget("slow", "u", "l4"), PodTarget("bare", "u", "cpu"),
               PodTarget("gone", "u", "cpu")]  # fmt: skip
    results = [Scraped("fast", fast), Scraped("slow", slow), Scraped("bare", bare),
               ScrapeFailed("gone", UNREACHABLE, "refused")]  # fmt: skip
    assert startup_by_pool(results, targets) == {
        "l4": {"pods": 2, "totalSeconds": 31.0, "phases": {"load": 4.0, "compile": 9.0}}}
    assert startup_by_pool(results[2:], targets) is None


def test_parse_the_runtimes_own_exposition() -> None:
    """The operator reads what hpi_runtime's /metrics writes (both sides of the hpi_contracts.metrics contract)."""
    metrics = pytest.importorskip("hpi_runtime.server.metrics", reason="the runtime package is not installed")
    from hpi_runtime.core.engine_io import EngineStats  # the engine's own stats: new fields keep their defaults

    serving = metrics.ServingMetrics("SmolLM2-135M-Instruct")
    serving.refresh(EngineStats(num_running=5, num_waiting=2, kv_cache_usage=0.625, prefix_cache_queries=0,
                                prefix_cache_hits=0, num_preemptions=1, num_prompt_tokens=10,
                                num_generation_tokens=20))  # fmt: skip
    text = serving.render().decode()
    # The counters the fleet optimizer's demand comes from, too: nothing finished yet, 10 prompt, 20 generated.
    # And the latency histograms its observed SLO attainment comes from: exported empty before any request.
    empty_ttft = tuple((le, 0.0) for le in (*metrics.LATENCY_BUCKETS_S, math.inf))
    empty_tpot = tuple((le, 0.0) for le in (*metrics.ITL_BUCKETS_S, math.inf))
    assert parse_load("p", text, model_name="SmolLM2-135M-Instruct") == PodLoad(
        "p", 0.625, 2.0, 5.0, num_finished=0.0, prompt_tokens=10.0, generation_tokens=20.0,
        ttft_buckets=empty_ttft, tpot_buckets=empty_tpot)
    serving.set_startup({"load": 1.25, "compile": 8.5}, 14.0)  # once ready: how it started
    started = parse_load("p", serving.render().decode(), model_name="SmolLM2-135M-Instruct")
    assert dict(started.startup_phases) == {"load": 1.25, "compile": 8.5} and started.startup_s == 14.0


def test_the_autoscaler_never_imports_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, hpi_operator.handlers, hpi_operator.autoscaling.handlers, hpi_operator.autoscaling.manifests; "
            "assert 'torch' not in sys.modules, 'torch imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
