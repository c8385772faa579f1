"""The routing decisions as pure functions: scores, proportional picking, bounded-load affinity, prefix keys,
the signals parsed from a real runtime metrics page, decode-speed measurement, EndpointSlice addresses."""

from __future__ import annotations

import dataclasses
import socket
from collections import Counter

import pytest

from hpi_router.affinity import HashRing, prefix_key
from hpi_router.backends import Backend, BackendView
from hpi_router.config import PolicySettings, RouterSettings
from hpi_router.discovery import ready_urls
from hpi_router.policy import Pick, pick
from hpi_router.signals import ScrapeSample, parse_metrics
from hpi_runtime.core.engine_io import EngineStats
from hpi_runtime.server.metrics import ServingMetrics

SETTINGS = PolicySettings()


def view(url: str, **fields) -> BackendView:
    return BackendView(url, **{"in_flight": 0, "num_running": 0.0, "num_waiting": 0.0, "kv_usage": 0.0,
                               "decode_speed": None, **fields})


def fill(views: list[BackendView], num_requests: int, key=None) -> Counter:
    """Pick `num_requests` times, each pick adding one request in flight to the chosen backend."""
    by_url = {v.url: v for v in views}
    for _ in range(num_requests):
        ring = HashRing(by_url).order(key) if key is not None else None
        chosen = pick(list(by_url.values()), ring, SETTINGS)
        by_url[chosen.url] = dataclasses.replace(by_url[chosen.url], in_flight=by_url[chosen.url].in_flight + 1)
    return Counter({url: v.in_flight for url, v in by_url.items()})


def test_load_goes_in_proportion_to_decode_speed() -> None:
    counts = fill([view("fast", decode_speed=40.0), view("slow", decode_speed=10.0)], 50)
    assert counts == {"fast": 40, "slow": 10}


def test_unmeasured_backends_count_as_the_median_and_equal_backends_share_evenly() -> None:
    counts = fill([view("a"), view("b"), view("c", decode_speed=20.0)], 30)
    assert counts == {"a": 10, "b": 10, "c": 10}


def test_scraped_queue_and_a_full_kv_cache_steer_away() -> None:
    views = [view("queued", num_running=4, num_waiting=3), view("idle")]
    assert pick(views, None, SETTINGS).url == "idle"
    views = [view("full", kv_usage=0.98), view("half", kv_usage=0.5, in_flight=2)]
    assert pick(views, None, SETTINGS).url == "half"
    assert pick(views, None, SETTINGS, exclude={"half"}).url == "full"
    assert pick(views, None, SETTINGS, exclude={"half", "full"}) is None


def test_affinity_sticks_to_one_backend_until_its_bound_then_spills() -> None:
    views = [view(u, decode_speed=10.0) for u in ("a", "b", "c")]
    ring = HashRing(["a", "b", "c"]).order("system prompt")
    first = pick(views, ring, SETTINGS)
    assert first.reason == "affinity"
    assert all(pick(views, HashRing(["a", "b", "c"]).order("system prompt"), SETTINGS).url == first.url
               for _ in range(5))
    # Under load the owner keeps more than a fair share (up to 1.5x), never everything; the overflow goes to
    # the next backend along the ring first.
    counts = fill(views, 30, key="system prompt")
    order = HashRing(["a", "b", "c"]).order("system prompt")
    assert order[0] == first.url
    assert 10 < counts[order[0]] <= 15 and counts[order[0]] >= counts[order[1]] >= counts[order[2]], counts


def test_affinity_never_picks_a_backend_many_times_slower_than_the_best() -> None:
    views = [view("fast", decode_speed=40.0), view("slow", decode_speed=4.0)]
    for key in (f"prompt {i}" for i in range(20)):  # half of these keys are owned by "slow"
        assert pick(views, HashRing(["fast", "slow"]).order(key), SETTINGS).url == "fast"


def test_ring_moves_only_the_removed_backends_keys() -> None:
    keys = [f"prompt {i}" for i in range(300)]
    before = HashRing(["a", "b", "c", "d"])
    after = HashRing(["a", "b", "c"])
    moved = [k for k in keys if before.order(k)[0] != after.order(k)[0]]
    assert all(before.order(k)[0] == "d" for k in moved)
    assert 40 < len(moved) < 110  # about a quarter
    assert set(before.order("x")) == {"a", "b", "c", "d"}


def test_prefix_key_covers_the_start_of_the_rendered_prompt() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    a = prefix_key({"model": "m", "messages": [system, {"role": "user", "content": "one"}]}, 256)
    b = prefix_key({"model": "m", "messages": [system, {"role": "user", "content": "two"}]}, 256)
    short = prefix_key({"model": "m", "messages": [{"role": "user", "content": "one"}]}, 256)
    assert a == b != short
    long_prompt = {"model": "m", "prompt": "x" * 300}
    assert prefix_key({**long_prompt, "prompt": "x" * 300 + "1"}, 256) == prefix_key(long_prompt, 256)
    assert prefix_key({"prompt": [1, 2, 3]}, 256) == prefix_key({"prompt": [[1, 2, 3]]}, 256)
    assert prefix_key({"prompt": "hello"}, 0) is None
    assert prefix_key({"prompt": 5}, 256) is None and prefix_key({"messages": "x"}, 256) is None
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prefix_key(parts, 256) == prefix_key({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, 256)


def test_signals_from_the_runtimes_own_metrics_page() -> None:
    stats = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.4, prefix_cache_queries=0, prefix_cache_hits=0,
                        num_preemptions=0, num_prompt_tokens=100, num_generation_tokens=250)  # fmt: skip
    metrics = ServingMetrics("m")
    metrics.refresh(stats)
    metrics.set_ready(True)
    sample = parse_metrics(metrics.render().decode())
    assert sample == ScrapeSample(num_running=3, num_waiting=2, kv_usage=0.4, generation_tokens=250, ready=True,
                                  model_names=frozenset({"m"}))  # fmt: skip
    assert parse_metrics("# some other server\nfoo_total 3\n") == ScrapeSample(None, None, None, None, None)


def test_decode_speed_is_tokens_per_second_per_running_request() -> None:
    backend = Backend("http://a")
    backend.observe(ScrapeSample(4, 0, 0.1, 1000, True), now_s=10.0)
    assert backend.decode_speed is None
    backend.observe(ScrapeSample(4, 0, 0.1, 1200, True), now_s=11.0)  # 200 tokens/s over 4 requests
    assert backend.decode_speed == pytest.approx(50.0)
    backend.observe(ScrapeSample(0, 0, 0.0, 1200, True), now_s=12.0)  # idle: no new information
    assert backend.decode_speed == pytest.approx(50.0)
    backend.observe(ScrapeSample(1, 0, 0.0, 1220, True), now_s=13.0)  # 20 tokens/s, one request
    assert backend.decode_speed == pytest.approx(0.3 * 20 + 0.7 * 50)
    backend.observe(ScrapeSample(1, 0, 0.0, 1220, True), now_s=14.0)  # running, nothing out: stalled
    assert backend.decode_speed == pytest.approx(0.7 * (0.3 * 20 + 0.7 * 50))


def test_ready_addresses_of_an_endpoint_slice() -> None:
    endpoint_slice = {
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "terminating": True}},
            {"addresses": ["10.0.0.3"]},  # unknown readiness reads as ready
            {"addresses": ["fd00::4"], "conditions": {"ready": True}},
        ],
    }
    assert ready_urls(endpoint_slice, "http") == {"http://10.0.0.1:8000", "http://10.0.0.3:8000",
                                                  "http://[fd00::4]:8000"}
    assert ready_urls(endpoint_slice, None) == {"http://10.0.0.1:9000", "http://10.0.0.3:9000",
                                                "http://[fd00::4]:9000"}
    assert ready_urls(endpoint_slice, "grpc") == set()
    assert ready_urls({"endpoints": None, "ports": None}, None) == set()


@pytest.mark.parametrize("kwargs, message", [
    ({}, "no backends"),
    ({"backend_urls": ("10.0.0.1:8000",)}, "must start with http"),
    ({"backend_urls": ("http://a",), "max_attempts": 0}, "at least 1"),
])
def test_settings_reject_bad_values(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        RouterSettings(**kwargs)
    with pytest.raises(ValueError, match="load factor"):
        PolicySettings(affinity_load_factor=0.5)


def test_round_robin_takes_turns_blind_to_load() -> None:
    settings = PolicySettings(strategy="round-robin")
    views = [view("a", num_picks=3, in_flight=9), view("b", num_picks=2, num_waiting=5), view("c", num_picks=3)]
    assert pick(views, HashRing(["a", "b", "c"]).order("k"), settings) == Pick("b", "round_robin")
    with pytest.raises(ValueError, match="unknown routing strategy"):
        PolicySettings(strategy="random")


def test_metrics_drop_the_series_of_removed_backends() -> None:
    from hpi_router.state import RouterState

    state = RouterState(RouterSettings(backend_urls=("http://a:1",)))
    state.pool.apply(["http://a:1", "http://b:2"])
    for url in ("http://a:1", "http://b:2"):
        state.metrics.picks.labels(url, "load").inc()
        state.metrics.latency.labels(url).observe(0.1)
    state.pool.apply(["http://a:1"])  # b left the EndpointSlice
    text = state.metrics.render().decode()
    assert 'backend="http://a:1"' in text and "http://b:2" not in text
    assert state.ring.order("k") == ["http://a:1"]


@pytest.mark.parametrize("argv, message", [
    ([], "no backends"),
    (["--backend", "10.0.0.1:8000"], "must start with http"),
    (["--backend", "http://a:1", "--affinity-load-factor", "0.9"], "load factor"),
])
def test_cli_refuses_bad_flags_with_exit_code_2(argv, message, capsys) -> None:
    from hpi_router.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_a_port_out_of_range_and_an_address_taken_with_exit_code_2(capsys, caplog) -> None:
    from hpi_router.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--backend", "http://a:1", "--port", "70000"])
    assert exited.value.code == 2 and "must be in [0, 65535]" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--backend", "http://a:1", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text and "address already in use" in caplog.text


def test_requests_stuck_before_the_engine_slow_the_speed_estimate() -> None:
    backend = Backend("http://a")
    backend.observe(ScrapeSample(1, 0, 0.0, 100, True), now_s=0.0)
    backend.in_flight = 5  # the router has 5 requests there; the engine runs 1 of them
    backend.observe(ScrapeSample(1, 0, 0.0, 110, True), now_s=1.0)
    assert backend.decode_speed == pytest.approx(10 / 3)  # 10 tokens/s over (1 + 5) / 2 busy requests
    backend.observe(ScrapeSample(0, 0, 0.0, 110, True), now_s=2.0)  # nothing running, 5 waiting on the router
    assert backend.decode_speed == pytest.approx(0.7 * 10 / 3)
