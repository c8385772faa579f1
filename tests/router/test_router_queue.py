"""The router as the activator: with no ready backend it holds requests in its queue (and says so on /ready and
/metrics, where the operator reads it as demand), sends each exactly once when a backend turns ready, waits again
when the first one dies while waking, and refuses beyond its bounds with a 503 and Retry-After. Real HTTP
throughout: the router on loopback, fake backends (conftest.py) as real aiohttp servers."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from hpi_contracts.metrics import ROUTER_QUEUED_REQUESTS
from hpi_router.config import QueueSettings
from hpi_testing.server import metric_samples

QUEUED = f"{ROUTER_QUEUED_REQUESTS}{{priority=0,tenant=default}}"


async def complete(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, dict, dict]:
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 3}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status, json.loads(await response.text()), dict(response.headers)


async def eventually(check, timeout_s: float = 10.0) -> None:
    """Wait for `check()` (sync or async) to hold: an event that must come, never a fixed sleep."""
    for _ in range(int(timeout_s / 0.02)):
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the condition never held")


async def queued(session: aiohttp.ClientSession, url: str) -> float:
    return metric_samples(await (await session.get(f"{url}/metrics")).text()).get(QUEUED, 0.0)


async def test_requests_at_zero_wait_and_each_goes_exactly_once_when_a_backend_is_ready(router, fake_backends) -> None:
    backend = await fake_backends()
    backend.ready = False  # the pool is at zero: its one pod is still loading
    async with router([backend.url], wait_ready=False) as state, aiohttp.ClientSession() as session:
        ready = await session.get(f"{state.url}/ready")
        assert ready.status == 200 and (await ready.json())["status"] == "queueing: no ready backend"
        clients = [asyncio.create_task(complete(session, state.url, f"q{i}")) for i in range(20)]
        await eventually(lambda: len(state.queue) == 20)
        assert await queued(session, state.url) == 20  # what the operator scales 0 -> 1 on
        assert backend.num_requests == 0 and not any(c.done() for c in clients)
        backend.ready = True  # the pod is up: the router's probe lets it in, the queue drains into it
        answers = await asyncio.gather(*clients)
        assert [status for status, _, _ in answers] == [200] * 20
        assert backend.num_requests == 20 and sorted(backend.prompts) == sorted(f'"q{i}"' for i in range(20))
        assert await queued(session, state.url) == 0
        samples = metric_samples(await (await session.get(f"{state.url}/metrics")).text())
        assert samples["hpi:router_queue_wait_seconds_count{priority=0,tenant=default}"] == 20


async def test_when_the_first_backend_dies_while_waking_the_requests_wait_for_the_next(router, fake_backends) -> None:
    first, second = await fake_backends(), await fake_backends()
    first.ready = second.ready = False
    first.die_on_request = True
    async with router([first.url, second.url], wait_ready=False) as state, aiohttp.ClientSession() as session:
        clients = [asyncio.create_task(complete(session, state.url, f"q{i}")) for i in range(10)]
        await eventually(lambda: len(state.queue) == 10)
        first.ready = True
        await eventually(lambda: first.num_requests >= 1 and not state.pool.get(first.url).ready)
        await eventually(lambda: len(state.queue) >= 1)  # back in the queue: nothing was answered
        assert not any(c.done() for c in clients)
        second.ready = True
        answers = await asyncio.gather(*clients)
        assert [status for status, _, _ in answers] == [200] * 10
        assert second.num_requests == 10  # every request once, on the backend that lived


async def test_beyond_its_bounds_the_queue_answers_503_with_retry_after(router, fake_backends) -> None:
    backend = await fake_backends()
    backend.ready = False
    bounded = QueueSettings(max_queued=2, max_wait_s=30)
    async with router([backend.url], wait_ready=False, queue=bounded) as state, aiohttp.ClientSession() as session:
        waiting = [asyncio.create_task(complete(session, state.url, f"q{i}")) for i in range(2)]
        await eventually(lambda: len(state.queue) == 2)
        status, body, headers = await complete(session, state.url, "one too many")
        assert status == 503 and body["error"]["code"] == "queue_full" and headers["Retry-After"] == "3"
        backend.ready = True
        assert [s for s, _, _ in await asyncio.gather(*waiting)] == [200, 200]
    short = QueueSettings(max_wait_s=0.2)
    backend.ready = False
    async with router([backend.url], wait_ready=False, queue=short) as state, aiohttp.ClientSession() as session:
        status, body, headers = await complete(session, state.url, "too late")
        assert status == 503 and body["error"]["code"] == "queue_timeout" and headers["Retry-After"] == "1"
        assert "within 0.2 s" in body["error"]["message"] and len(state.queue) == 0
        samples = metric_samples(await (await session.get(f"{state.url}/metrics")).text())
        assert samples["hpi:router_unrouted_requests_total{reason=queue_timeout}"] == 1


async def test_with_saturated_waiting_set_requests_wait_while_every_engine_has_a_queue(router, fake_backends) -> None:
    backend = await fake_backends(token_delay_s=0.01)
    hold = QueueSettings(saturated_waiting=2)
    slow_scrape = 5.0  # no scrape within the test: the two sent count as waiting there until they finish
    async with router([backend.url], queue=hold, scrape_interval_s=slow_scrape) as state, \
            aiohttp.ClientSession() as session:  # fmt: skip
        # Two sent since the last scrape count as waiting there: the third waits in the router.
        clients = [asyncio.create_task(complete(session, state.url, f"q{i}")) for i in range(6)]
        await eventually(lambda: len(state.queue) > 0 or all(c.done() for c in clients))
        answers = await asyncio.gather(*clients)
        assert [s for s, _, _ in answers] == [200] * 6 and backend.num_requests == 6
        samples = metric_samples(await (await session.get(f"{state.url}/metrics")).text())
        assert samples["hpi:router_queue_wait_seconds_count{priority=0,tenant=default}"] >= 1


async def test_two_hundred_requests_at_zero_complete_or_get_the_documented_503(router, fake_backends) -> None:
    """Issue 38's bar: sent while the pool is at zero, every request is answered (served, or a 503 queue_full with
    Retry-After beyond the bound), never a connection error."""
    backend = await fake_backends()
    backend.ready = False
    bounded = QueueSettings(max_queued=150)
    async with router([backend.url], wait_ready=False, queue=bounded) as state, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:  # fmt: skip
        clients = [asyncio.create_task(complete(session, state.url, f"q{i}")) for i in range(200)]
        await eventually(lambda: len(state.queue) == 150 and sum(c.done() for c in clients) == 50)
        backend.ready = True
        answers = await asyncio.gather(*clients)  # a connection error would raise here
    served = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] != 200]
    assert len(served) == 150 and backend.num_requests == 150
    assert len(refused) == 50 and all(status == 503 and body["error"]["code"] == "queue_full"
                                      and headers["Retry-After"] for status, body, headers in refused)  # fmt: skip
