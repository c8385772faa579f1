"""Pool profiles as the router's prior for a backend's speed: parsed from the runtime's own /metrics page, used
until a speed is measured, then corrected by measurement; a page without them routes exactly as before."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpi_contracts.pool_profile import PoolProfile
from hpi_router.backends import BackendView
from hpi_router.config import PolicySettings
from hpi_router.policy import MIN_SPEED_FRACTION, rating_of, speed_of, speed_scale
from hpi_router.pool import BackendPool
from hpi_router.signals import ScrapeSample, parse_metrics
from hpi_runtime.core.engine_io import EngineStats
from hpi_runtime.server.metrics import ServingMetrics

FAST = PoolProfile(itl_alpha_ms=10.0, itl_beta_ms=1.0, prefill_tokens_per_s=5000.0, max_num_seqs=64)
SLOW = PoolProfile(itl_alpha_ms=50.0, itl_beta_ms=5.0, prefill_tokens_per_s=500.0, max_num_seqs=8, source="assumed")


def page(profile: PoolProfile | None, num_running: int = 0, num_generation_tokens: int = 0) -> str:
    """A /metrics page as `hpi serve --pool-profile` renders it (the runtime's own ServingMetrics)."""
    metrics = ServingMetrics("m")
    metrics.refresh(EngineStats(num_running=num_running, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                                prefix_cache_hits=0, num_preemptions=0, num_prompt_tokens=0,
                                num_generation_tokens=num_generation_tokens))  # fmt: skip
    metrics.set_ready(True)
    if profile is not None:
        metrics.set_pool_profile(profile)
    return metrics.render().decode()


def ready_pool(urls: list[str]) -> BackendPool:
    pool = BackendPool(PolicySettings(affinity_prefix_chars=0))
    pool.apply(urls)
    for url in urls:
        pool.restore(pool.get(url))
    return pool


def send(pool: BackendPool, num_requests: int) -> Counter:
    """`num_requests` picks, each staying in flight."""
    counts: Counter = Counter()
    for _ in range(num_requests):
        backend = pool.get(pool.choose(None).url)
        pool.started(backend)
        counts[backend.url] += 1
    return counts


def test_profile_gauges_parse_into_the_sample_and_an_incomplete_set_is_no_profile() -> None:
    assert parse_metrics(page(SLOW)).profile == SLOW
    assert parse_metrics(page(None)).profile is None
    without_beta = "\n".join(line for line in page(FAST).splitlines() if "profile_itl_beta" not in line)
    assert parse_metrics(without_beta).profile is None
    assert parse_metrics(without_beta).num_running == 0  # the rest of the page still counts


def test_a_new_backend_with_a_fast_profile_takes_more_traffic_before_any_measurement() -> None:
    pool = ready_pool(["http://fast", "http://slow"])
    pool.observe(pool.get("http://fast"), parse_metrics(page(FAST)), now_s=0.0)
    pool.observe(pool.get("http://slow"), parse_metrics(page(SLOW)), now_s=0.0)
    pool.rescale()
    counts = send(pool, 40)
    assert all(b.decode_speed is None for b in pool.all())  # nothing measured: the priors decided
    # Per sequence FAST makes 1000 / (10 + b) tok/s with b running, SLOW 1000 / (50 + 5 b) (b <= 8): loads settle
    # where the scores (b + 1) / speed meet, 28 against 12.
    assert counts == {"http://fast": 28, "http://slow": 12}
    unprofiled = ready_pool(["http://a", "http://b"])
    assert set(send(unprofiled, 40).values()) == {20}  # the same two without profiles: even


def test_measurement_overrides_a_wrong_prior_within_a_few_scrapes() -> None:
    pool = ready_pool(["http://liar", "http://honest"])
    liar, honest = pool.get("http://liar"), pool.get("http://honest")
    claims = PoolProfile(itl_alpha_ms=10.0, itl_beta_ms=0.0, prefill_tokens_per_s=1000.0, max_num_seqs=16)  # 100/s
    tokens = Counter()

    def scrape(t: int) -> None:  # one request running on each: the liar really makes 10 tokens/s, honest 40
        for backend, rate, profile in ((liar, 10, claims), (honest, 40, None)):
            tokens[backend.url] += rate if t else 0
            pool.observe(backend, parse_metrics(page(profile, 1, tokens[backend.url])), now_s=float(t))
        pool.rescale()

    scrape(0)
    assert liar.decode_speed is None and honest.decode_speed is None
    # The liar's prior (100 tok/s) is the only speed known: the honest one counts as its median, i.e. the same.
    assert pool.scale.default == pytest.approx(100)
    scrape(1)
    # The first measurement moves the prior by the EWMA's weight; it does not replace it.
    assert liar.decode_speed == pytest.approx(0.3 * 10 + 0.7 * 100)
    assert honest.decode_speed == pytest.approx(40)  # no prior: the first sample is the estimate
    for t in range(2, 10):
        scrape(t)
    assert liar.decode_speed == pytest.approx(10 + 0.7**9 * 90) and liar.decode_speed < 15
    counts = send(pool, 20)
    assert counts[honest.url] > 2 * counts[liar.url], counts


def test_a_prior_counts_at_the_batch_running_there_now() -> None:
    view = BackendView("http://a", in_flight=3, num_running=5.0, num_waiting=0.0, kv_usage=0.0, decode_speed=None,
                       profile=SLOW)
    scale = speed_scale([view])
    assert speed_of(view, scale) == pytest.approx(SLOW.tokens_per_s_per_sequence(5))
    crowded = BackendView("http://a", in_flight=30, num_running=0.0, num_waiting=0.0, kv_usage=0.0,
                          decode_speed=None, profile=SLOW)  # beyond maxNumSeqs (8) requests wait, not slow the batch
    assert speed_of(crowded, scale) == pytest.approx(SLOW.tokens_per_s_per_sequence(8))


def old_speeds(views: list[BackendView]) -> dict[str, float]:
    """The rule before profiles existed (policy.speeds at 3c2a292), restated: the test's fixed point."""
    measured = [v.decode_speed for v in views if v.decode_speed]
    default = statistics.median(measured) if measured else 1.0
    floor = MIN_SPEED_FRACTION * max(measured, default=default)
    return {v.url: max(v.decode_speed or default, floor) for v in views}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.none() | st.just(0.0) | st.floats(0.01, 1000.0), st.integers(0, 20),
                          st.integers(0, 20)), min_size=1, max_size=12))
def test_without_profile_gauges_every_speed_is_as_before(backends) -> None:
    views = [BackendView(f"http://b{i}", in_flight=in_flight, num_running=float(running), num_waiting=0.0,
                         kv_usage=0.0, decode_speed=speed)
             for i, (speed, in_flight, running) in enumerate(backends)]
    scale = speed_scale(views)
    assert {v.url: speed_of(v, scale) for v in views} == old_speeds(views)
    assert parse_metrics(page(None, 2, 50)) == ScrapeSample(2, 0, 0.0, 50, True, None, model_names=frozenset({"m"}))


# Llama-3.1-8B on an H200 and on an L4 at int8 (bench/fleet_sim/pools.py), and the batches the fleet optimizer
# plans each at within a 2 s / 100 ms SLO at the Azure conversation mix (hpi_operator.fleet.performance).
H200 = PoolProfile(6.8, 0.086, 30000.0, 512, "assumed")
L4 = PoolProfile(50.4, 0.92, 3014.0, 76, "assumed")


def profiled_pool(profiles: dict[str, PoolProfile]) -> BackendPool:
    pool = ready_pool(list(profiles))
    for url, profile in profiles.items():
        pool.observe(pool.get(url), parse_metrics(page(profile)), now_s=0.0)
    pool.rescale()
    return pool


def test_the_planned_slo_batch_parses_from_the_page_and_is_optional() -> None:
    planned = replace(L4, slo_max_num_seqs=13)
    assert parse_metrics(page(planned)).profile == planned
    assert parse_metrics(page(L4)).profile == L4  # a pod without a plan: the profile as before


def test_planned_shares_keep_each_pool_at_its_slo_batch_where_speed_overfills_the_slow_one() -> None:
    by_speed = profiled_pool({"http://h200": H200, "http://l4": L4})
    # By speed the L4 takes requests until its per-request speed at its batch matches the H200's at its own: 70,
    # five times the 13 it serves within the SLO (its prefills then stall its decodes past the ITL target).
    assert send(by_speed, 339) == {"http://h200": 269, "http://l4": 70}
    planned = profiled_pool({"http://h200": replace(H200, slo_max_num_seqs=326),
                             "http://l4": replace(L4, slo_max_num_seqs=13)})  # fmt: skip
    assert send(planned, 339) == {"http://h200": 326, "http://l4": 13}  # load in proportion to the plan
    more = send(planned, 339)  # past the plan: still in proportion
    assert more["http://l4"] == 13 and more["http://h200"] == 326


def test_one_backend_without_a_plan_puts_the_whole_fleet_back_on_speed() -> None:
    mixed = profiled_pool({"http://h200": replace(H200, slo_max_num_seqs=326), "http://l4": L4})
    assert send(mixed, 339) == {"http://h200": 269, "http://l4": 70}  # the two scales never mix


def test_within_planned_shares_a_replica_slower_than_its_peers_loses_share_and_a_slow_pool_keeps_its_plan() -> None:
    """Planned shares still correct online: a backend measured slower than the median of the backends with the
    same profile (against the profile's speed at the batch each runs) has its share cut in that proportion."""
    profile = replace(L4, slo_max_num_seqs=13)
    urls = ["http://l4-a", "http://l4-b", "http://l4-c"]
    per_request = profile.tokens_per_s_per_sequence(1)  # one request running on each, at the profile's speed

    def measured(speeds: dict[str, float]) -> BackendPool:
        pool = ready_pool(urls)
        tokens = Counter()
        for t in range(12):  # scrapes a second apart; the EWMA settles on each backend's true speed
            for url in urls:
                tokens[url] += speeds[url] * per_request if t else 0
                pool.observe(pool.get(url), parse_metrics(page(profile, 1, int(tokens[url]))), now_s=float(t))
            pool.rescale()
        return pool

    throttled = measured({"http://l4-a": 1.0, "http://l4-b": 1.0, "http://l4-c": 0.4})
    shares = {url: rating_of(pool_view, throttled.scale) for url, pool_view in
              ((b.url, b.view()) for b in throttled.all())}  # fmt: skip
    assert shares["http://l4-a"] == pytest.approx(13, rel=0.02) and shares["http://l4-b"] == pytest.approx(13, rel=0.02)
    assert shares["http://l4-c"] == pytest.approx(13 * 0.4, rel=0.05)
    counts = send(throttled, 31)
    assert counts["http://l4-c"] < counts["http://l4-a"] / 2  # about 0.4 of a healthy peer's load
    uniformly_slow = measured(dict.fromkeys(urls, 0.5))  # the whole pool at half its figures: the plan's to fix
    assert all(rating_of(b.view(), uniformly_slow.scale) == pytest.approx(13, rel=0.02) for b in uniformly_slow.all())
