"""LoRA adapter affinity in the router: vLLM's `vllm:lora_requests_info` read from a metrics page (the newest state
wins), a request for an adapter goes where the adapter is resident while that backend is within its bounded
load, base-model requests are not affected, and the holder index stays in step with the backends' states."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp

from hpi_router.config import PolicySettings
from hpi_router.pool import BackendPool
from hpi_router.signals import LoraState, ScrapeSample, parse_metrics

BASE = "smollm"
PAGE = """\
# HELP vllm:num_requests_running Running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="smollm"} 2.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="math"} 1.8e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.75e9
"""


def test_the_newest_lora_state_and_the_base_names_come_from_the_page() -> None:
    sample = parse_metrics(PAGE)
    assert sample.lora == LoraState(frozenset({"sql", "chat", "math"}), 4)
    assert sample.model_names == {BASE}
    assert parse_metrics(PAGE.replace('max_lora="4"', 'max_lora="x"')).lora is None  # not a count: no state
    without = parse_metrics("\n".join(line for line in PAGE.splitlines() if "lora" not in line) + "\n")
    assert without.lora is None and without.num_running == 2.0


def sample(running: int = 0, active: tuple[str, ...] = (), max_loras: int | None = 2) -> ScrapeSample:
    lora = LoraState(frozenset(active), max_loras) if max_loras is not None else None
    return ScrapeSample(running, 0, 0.1, None, True, lora=lora, model_names=frozenset({BASE}))


def fleet(*states: ScrapeSample) -> BackendPool:
    pool = BackendPool(PolicySettings())
    urls = [f"http://b{i}" for i in range(len(states))]
    pool.apply(urls)
    for url, state in zip(urls, states, strict=True):
        backend = pool.get(url)
        pool.restore(backend)
        pool.observe(backend, state)
    pool.rescale()
    return pool


def send(pool: BackendPool, model: str, num_requests: int) -> Counter:
    """Pick for `num_requests` requests of `model`, each one staying in flight: (reason, backend) counts."""
    counts: Counter = Counter()
    adapter = pool.adapter_of(model)
    for _ in range(num_requests):
        pick = pool.choose(None, adapter=adapter)
        pool.started(pool.get(pick.url), adapter)
        counts[pick.reason, pick.url] += 1
    return counts


def test_an_adapters_requests_go_where_it_is_resident_up_to_the_bound_then_to_a_free_slot() -> None:
    # b0 holds "a" and "b" (both of its slots), b1 holds "c"; all four run 4 requests.
    pool = fleet(sample(4, ("a", "b")), sample(4, ("c",)), sample(4), sample(4))
    assert pool.adapter_of(BASE) is None and pool.adapter_of(None) is None and pool.adapter_of("a") == "a"
    # The bound: b0 takes "a" while its load + 1 stays within 1.5x a quarter of the fleet's (+1), rounded up:
    # 4 + k + 1 <= ceil(1.5 * (17 + k) / 4) for k = 0..3. The fifth goes to the lowest score with a free slot
    # (never b0: both its slots are in use), which holds "a" from then on and takes the sixth.
    counts = send(pool, "a", 6)
    assert counts[("adapter", "http://b0")] == 4
    (spilled,) = {url for _, url in counts if url != "http://b0"}
    assert counts[("adapter_slot", spilled)] == 1 and counts[("adapter", spilled)] == 1
    assert pool.holders("a") == 2


def test_a_new_adapter_avoids_a_backend_whose_slots_are_full_and_the_base_model_does_not() -> None:
    pool = fleet(sample(1, ("a", "b")), sample(4, ("c",)), sample(4), sample(4))
    assert pool.choose(None).url == "http://b0"  # the least loaded, for the base model
    pick = pool.choose(None, adapter="d")
    assert pick.reason == "adapter_slot" and pick.url != "http://b0"
    # Without a known slot limit (LoRA state not scraped), every backend counts as having room.
    assert fleet(sample(1, max_loras=None), sample(4)).choose(None, adapter="d").url == "http://b0"
    # The base model's requests are spread by load, never by adapter.
    base = send(fleet(sample(), sample(), sample(), sample()), BASE, 8)
    assert {reason for reason, _ in base} == {"load"} and len(base) == 4


def test_holders_follow_scrapes_requests_and_readiness() -> None:
    pool = fleet(sample(4), sample(4), sample(4, ("chat",)))
    resident = pool.get("http://b2")
    assert pool.choose(None, adapter="chat").url == "http://b2"
    assert pool.choose(None, adapter="chat", exclude={"http://b2"}).reason == "adapter_slot"  # a retry: elsewhere
    # An adapter sent by this router is resident until its requests end and a scrape no longer shows it.
    other = pool.get("http://b0")
    pool.started(other, "sql")
    assert pool.holders("sql") == 1 and pool.choose(None, adapter="sql").url == "http://b0"
    pool.finished(other, "sql")
    assert pool.holders("sql") == 0
    pool.observe(resident, sample(4))
    assert pool.holders("chat") == 0
    pool.started(resident, "sql")
    pool.eject(resident, "gone")  # holders leave the index with their backend
    assert pool.holders("sql") == 0
    pool.restore(resident)
    assert pool.holders("sql") == 1


async def test_an_adapters_404_moves_on_to_a_backend_that_has_it_and_an_unknown_one_is_a_404(
        router, fake_backends) -> None:  # fmt: skip
    missing, holder = await fake_backends(), await fake_backends()
    missing.adapters, holder.adapters = set(), {"sql"}  # `missing` has just started: nothing loaded yet
    async with router([missing.url, holder.url]) as state, aiohttp.ClientSession() as s:
        while not state.pool.base_names:  # the first scrapes name the base model: then "sql" is an adapter
            await asyncio.sleep(0.02)
        for i in range(6):
            body = {"model": "sql", "prompt": f"q{i}", "max_tokens": 2}
            async with s.post(f"{state.url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
        assert holder.num_requests == 6 and missing.num_requests == 0
        async with s.post(f"{state.url}/v1/completions", json={"model": "nope", "prompt": "q"}) as response:
            error = (await response.json())["error"]
            assert response.status == 404 and error["code"] == "model_not_found" and "'nope'" in error["message"]
        assert missing.ready and holder.ready  # a 404 is no fault of the backend: nobody was ejected
