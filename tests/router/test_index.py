"""The pool's O(log n) pick against the scan it replaces: the same backend for any fleet state and any
sequence of requests, scrapes and readiness changes; and work per request (counted, not timed) that grows with
log n, where the scan's grows with n."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hpi_router.policy as policy
import hpi_router.pool as pool_module
from hpi_contracts.pool_profile import PoolProfile
from hpi_router.affinity import HashRing
from hpi_router.config import PolicySettings
from hpi_router.index import RankIndex
from hpi_router.policy import MAX_AFFINITY_PROBES, pick, rank
from hpi_router.pool import BackendPool
from hpi_router.signals import ScrapeSample

KEYS = (None, "system prompt a", "system prompt b", "another")
# With and without the fleet optimizer's planned SLO batch: all planned shares by it, a mixed fleet by speed.
PROFILES = (None, PoolProfile(10.0, 1.0, 1000.0, 8), PoolProfile(80.0, 8.0, 100.0, 2, "assumed"),
            PoolProfile(10.0, 1.0, 1000.0, 8, slo_max_num_seqs=6),
            PoolProfile(80.0, 8.0, 100.0, 2, "assumed", slo_max_num_seqs=1))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("set", "remove", "lowest")), st.integers(0, 15), st.integers(0, 6)),
                max_size=80))
def test_rank_index_keeps_the_lowest_of_a_changing_set(ops) -> None:
    index, model = RankIndex(), {}
    for op, name, value in ops:
        url = f"u{name}"
        if op == "set":
            index.set(url, (value, url))
            model[url] = (value, url)
        elif op == "remove":
            index.remove(url)
            model.pop(url, None)
        excluded = {f"u{i}" for i in range(value)}  # lowest outside u0..u{value-1}
        rest = [rank for url, rank in model.items() if url not in excluded]
        assert index.lowest(excluded) == (min(rest)[1] if rest else None)
        assert len(index) == len(model)


backend_state = st.tuples(
    st.booleans(),  # ready
    st.integers(0, 6),  # in flight
    st.integers(0, 8), st.integers(0, 4),  # scraped running, waiting
    st.sampled_from((0.0, 0.5, 0.85, 0.97)),  # KV usage
    st.none() | st.just(0.0) | st.floats(0.5, 200.0),  # measured decode speed
    st.sampled_from(PROFILES),
    st.integers(0, 3),  # picks so far
)
operation = st.one_of(
    st.tuples(st.just("request"), st.sampled_from(KEYS), st.integers(0, 2**16)),
    st.tuples(st.just("finish"), st.integers(0, 15)),
    st.tuples(st.just("scrape"), st.integers(0, 15), st.integers(0, 8), st.integers(0, 3), st.integers(0, 200),
              st.sampled_from(PROFILES)),
    st.tuples(st.just("eject"), st.integers(0, 15)),
    st.tuples(st.just("restore"), st.integers(0, 15)),
    st.tuples(st.just("rescale")),
)


def check_against_the_scan(pool: BackendPool, ring: HashRing, rules: PolicySettings, exclude: set[str]) -> None:
    views = [b.view() for b in pool.ready()]
    # The index holds exactly the ready backends, each at the rank the scan would give it now.
    assert {v.url: pool.index.rank(v.url) for v in views} == {v.url: rank(v, pool.scale, rules) for v in views}
    assert len(pool.index) == len(views)
    for key in KEYS:
        indexed = pool.choose(ring.walk(key) if key is not None else None, exclude)
        scanned = pick(views, ring.order(key) if key is not None else None, rules, exclude, pool.scale)
        assert indexed == scanned, (key, exclude)


@settings(max_examples=250, deadline=None)
@given(st.sampled_from(("load", "round-robin")), st.lists(backend_state, min_size=1, max_size=12),
       st.lists(operation, max_size=40))
def test_the_indexed_pick_is_the_scans_pick(strategy, states, ops) -> None:
    rules = PolicySettings(strategy=strategy)
    pool = BackendPool(rules)
    urls = [f"http://b{i}" for i in range(len(states))]
    pool.apply(urls)
    ring = HashRing(urls)
    for url, (ready, in_flight, running, waiting, kv, speed, profile, picks) in zip(urls, states, strict=True):
        backend = pool.get(url)  # a fleet state as it could be mid-run; rescale ranks it all
        backend.ready, backend.in_flight, backend.num_picks = ready, in_flight, picks
        backend.num_running, backend.num_waiting, backend.kv_usage = float(running), float(waiting), kv
        backend.decode_speed, backend.profile = speed, profile
    pool.rescale()
    tokens = {url: 0 for url in urls}
    now_s = 0.0
    check_against_the_scan(pool, ring, rules, set())
    for op in ops:
        backend = pool.get(urls[op[1] % len(urls)]) if op[0] in ("finish", "scrape", "eject", "restore") else None
        if op[0] == "request":  # a request, retried on up to three backends as the proxy does
            _, key, seed = op
            tried: set[str] = set()
            for _ in range(1 + seed % 3):
                check_against_the_scan(pool, ring, rules, tried)
                choice = pool.choose(ring.walk(key) if key is not None else None, tried)
                if choice is None:
                    break
                tried.add(choice.url)
                pool.started(pool.get(choice.url))
        elif op[0] == "finish" and backend.in_flight > 0:
            pool.finished(backend)
        elif op[0] == "scrape":
            _, _, running, waiting, new_tokens, profile = op
            now_s += 0.25
            tokens[backend.url] += new_tokens
            pool.observe(backend, ScrapeSample(running, waiting, 0.5, tokens[backend.url], True, profile), now_s)
        elif op[0] == "eject":
            pool.eject(backend, "test")
        elif op[0] == "restore":
            pool.restore(backend)
        elif op[0] == "rescale":
            pool.rescale()
        check_against_the_scan(pool, ring, rules, set())


def test_affinity_tries_at_most_max_affinity_probes_backends() -> None:
    urls = [f"http://b{i:02d}" for i in range(20)]
    pool, ring = BackendPool(PolicySettings()), HashRing(urls)
    pool.apply(urls)
    path = ring.order("a hot prefix")
    for url in urls:
        backend = pool.get(url)
        backend.ready, backend.decode_speed = True, 10.0
        backend.in_flight = 10 if url in path[:MAX_AFFINITY_PROBES] else 0  # the first ones are all full
    pool.get(path[MAX_AFFINITY_PROBES]).num_picks = 5  # the next one along would have room, but is not tried
    pool.rescale()
    choice = pool.choose(ring.walk("a hot prefix"))
    assert choice.reason == "load" and choice.url not in path[:MAX_AFFINITY_PROBES + 1]
    pool.get(path[3]).in_flight = 0  # one of the first ones has room again: affinity
    pool.rescale()
    assert pool.choose(ring.walk("a hot prefix")) == policy.Pick(path[3], "affinity")


def fleet(num_backends: int, seed: int) -> tuple[BackendPool, HashRing]:
    rng = random.Random(seed)
    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(num_backends)]
    pool = BackendPool(PolicySettings())
    pool.apply(urls)
    for url in urls:
        backend = pool.get(url)
        backend.ready = True
        backend.decode_speed = rng.choice((None, rng.uniform(5, 100)))
        backend.profile = rng.choice(PROFILES)
        backend.num_running = float(rng.randint(0, 6))
    pool.rescale()
    return pool, HashRing(urls)


def work_per_request(num_backends: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int]:
    """The most index steps, rank evaluations and affinity checks one request cost (pick, start, finish) over
    a stream of requests with prefix keys, retries and finishes."""
    pool, ring = fleet(num_backends, seed=num_backends)
    calls = {"rank": 0, "affinity_fits": 0}

    def counted(name):
        real = getattr(pool_module, name)

        def wrapper(*args):
            calls[name] += 1
            return real(*args)
        return wrapper

    for name in calls:
        monkeypatch.setattr(pool_module, name, counted(name))
    rng = random.Random(7)
    in_flight = []
    worst = (0, 0, 0)
    for i in range(600):
        steps0, ranks0, fits0 = pool.index.num_steps, calls["rank"], calls["affinity_fits"]
        key = f"system prompt {rng.randrange(40)}" if rng.random() < 0.7 else None
        exclude = {in_flight[-1].url} if in_flight and i % 5 == 0 else set()  # now and then a retry
        choice = pool.choose(ring.walk(key) if key is not None else None, exclude)
        backend = pool.get(choice.url)
        pool.started(backend)
        in_flight.append(backend)
        if len(in_flight) > 3 * num_backends or rng.random() < 0.45:
            pool.finished(in_flight.pop(rng.randrange(len(in_flight))))
        worst = max(worst[0], pool.index.num_steps - steps0), max(worst[1], calls["rank"] - ranks0), \
            max(worst[2], calls["affinity_fits"] - fits0)
        if i % 100 == 99:
            pool.rescale()  # a scrape round: O(n log n), not counted per request
    return worst


def test_work_per_pick_grows_with_log_n_not_n(monkeypatch: pytest.MonkeyPatch) -> None:
    for num_backends in (10, 100, 1000):
        steps, ranks, fits = work_per_request(num_backends, monkeypatch)
        assert steps <= 4 * math.log2(num_backends) + 4, (num_backends, steps)
        assert ranks <= 2 and fits <= MAX_AFFINITY_PROBES, (num_backends, ranks, fits)
    # The same counter sees a scan: the reference pick ranks every backend, once per request.
    pool, _ = fleet(1000, seed=1)
    num_ranked = 0

    def counted_rank(*args):
        nonlocal num_ranked
        num_ranked += 1
        return real_rank(*args)

    real_rank = policy.rank
    monkeypatch.setattr(policy, "rank", counted_rank)
    pick([b.view() for b in pool.ready()], None, PolicySettings(), (), pool.scale)
    assert num_ranked == 1000 > 4 * math.log2(1000) + 4
