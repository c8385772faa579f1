"""The router in front of small real aiohttp backends (conftest's FakeBackend: exact speeds, instant start):
proportional picking, affinity, streaming pass-through, disconnects, failover, ejection and probing back,
its own endpoints and bad input. Real `hpi serve` backends are in test_real_backends.py."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from hpi_router import monitor
from hpi_router.config import PolicySettings, QueueSettings
from hpi_testing.server import metric_samples

NO_AFFINITY = {"policy": PolicySettings(affinity_prefix_chars=0)}  # the load policy alone decides
SYSTEM_PROMPT = "You are the assistant of a paged KV cache. Answer briefly and exactly. " * 6


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 4,
                   stream: bool = False) -> tuple[int, str]:
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status, await response.text()


async def closed_loop(url: str, prompts: list[str], concurrency: int, max_tokens: int,
                      stream: bool = True) -> list[int]:
    queue = list(prompts)
    statuses: list[int] = []
    async with aiohttp.ClientSession() as session:
        async def client() -> None:
            while queue:
                statuses.append((await complete(session, url, queue.pop(), max_tokens, stream))[0])
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return statuses


async def test_a_slow_backend_gets_proportionally_fewer_requests(router, fake_backends) -> None:
    fast_a, fast_b = await fake_backends(token_delay_s=0.003), await fake_backends(token_delay_s=0.003)
    # 20x slower per token: a margin that survives a loaded machine, where a 3 ms sleep was seen to take several
    # times that (at 8x the slow backend's measured speed came within 2x of a fast one's at a load average of 8).
    slow = await fake_backends(token_delay_s=0.06)
    async with router([fast_a.url, fast_b.url, slow.url], **NO_AFFINITY) as state:
        prompts = [f"question {i}" for i in range(90)]
        statuses = await closed_loop(state.url, prompts, concurrency=9, max_tokens=12)
        speeds = {b.url: b.decode_speed for b in state.pool.all()}
    assert statuses == [200] * 90
    assert speeds[slow.url] < speeds[fast_a.url] / 2  # the router measured the difference
    # Round-robin would give each 30; proportional to speed the slow one gets ~5 of 90.
    assert slow.num_requests < 20, (fast_a.num_requests, fast_b.num_requests, slow.num_requests)
    assert fast_a.num_requests > 1.5 * slow.num_requests and fast_b.num_requests > 1.5 * slow.num_requests


async def test_same_prefix_requests_go_to_one_backend(router, fake_backends) -> None:
    backends = [await fake_backends() for _ in range(3)]
    async with router([b.url for b in backends]) as state, aiohttp.ClientSession() as session:
        for i in range(12):  # one at a time: the owner is never over its bound
            status, _ = await complete(session, state.url, SYSTEM_PROMPT + f"question {i}")
            assert status == 200
        for i in range(12):
            await complete(session, state.url, f"an unrelated prompt number {i} " * 3)
        metrics = metric_samples(await (await session.get(f"{state.url}/metrics")).text())
    owner = max(backends, key=lambda b: b.num_requests)
    assert sum(SYSTEM_PROMPT in p for p in owner.prompts) == 12
    assert all(not any(SYSTEM_PROMPT in p for p in b.prompts) for b in backends if b is not owner)
    assert sum(b.num_requests > 0 for b in backends) >= 2  # unrelated prompts spread out
    assert metrics[f"hpi:router_picks_total{{backend={owner.url},reason=affinity}}"] >= 12


async def test_streams_pass_through_chunk_by_chunk(router, fake_backends) -> None:
    backend = await fake_backends(token_delay_s=0.05)
    async with router([backend.url]) as state, aiohttp.ClientSession() as session:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 6, "stream": True}
        arrivals = []
        async with session.post(f"{state.url}/v1/completions", json=body) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            async for line in response.content:
                if line.startswith(b"data: {"):
                    arrivals.append((asyncio.get_running_loop().time(), backend.stats.num_generation_tokens))
                    assert json.loads(line[6:])["choices"][0]["text"] == "tok "
        assert len(arrivals) == 6
        # Each chunk reached the client before the backend had decoded the next token: nothing buffered.
        assert [tokens for _, tokens in arrivals] == [1, 2, 3, 4, 5, 6]


async def test_client_disconnect_cancels_the_upstream_request(router, fake_backends) -> None:
    backend = await fake_backends(token_delay_s=0.05)
    async with router([backend.url]) as state:
        async with aiohttp.ClientSession() as session:
            body = {"model": "fake-model", "prompt": "hi", "max_tokens": 1000, "stream": True}
            async with session.post(f"{state.url}/v1/completions", json=body) as response:
                await response.content.readline()
        assert await wait_until(lambda: backend.num_cancelled == 1)
        assert backend.stats.num_generation_tokens < 100
        assert state.pool.get(backend.url).in_flight == 0
        assert state.pool.get(backend.url).ready  # the client left; the backend did nothing wrong


async def wait_until(check, timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


async def test_failover_before_the_first_byte_then_ejection_and_probe_back(router, fake_backends) -> None:
    good, refusing = await fake_backends(), await fake_backends()
    async with router([good.url, refusing.url], **NO_AFFINITY) as state, aiohttp.ClientSession() as session:
        refusing.fail_status = 503  # refuses requests while /ready and hpi:ready still say yes
        statuses = [(await complete(session, state.url, f"q{i}"))[0] for i in range(6)]
        assert statuses == [200] * 6 and good.num_requests == 6
        metrics = metric_samples(await (await session.get(f"{state.url}/metrics")).text())
        assert metrics[f"hpi:router_retries_total{{backend={refusing.url},reason=http_503}}"] >= 1
        assert metrics[f"hpi:router_ejections_total{{backend={refusing.url}}}"] >= 1
        refusing.ready = False  # draining: the scrape's hpi:ready 0 ejects it without a request
        assert await wait_until(lambda: not state.pool.get(refusing.url).ready)
        refusing.fail_status, refusing.ready = None, True
        assert await wait_until(lambda: state.pool.get(refusing.url).ready)  # probed back through /ready
        await closed_loop(state.url, [f"q{i}" for i in range(8)], concurrency=4, max_tokens=20)
        assert refusing.num_requests > 0


async def test_a_dead_backend_is_ejected_and_its_requests_retried(router, fake_backends) -> None:
    good, doomed = await fake_backends(), await fake_backends()
    async with router([good.url, doomed.url], **NO_AFFINITY) as state:
        await doomed.stop()  # connection refused from now on
        statuses = await closed_loop(state.url, [f"q{i}" for i in range(10)], concurrency=5, max_tokens=3,
                                     stream=False)
        assert statuses == [200] * 10
        assert not state.pool.get(doomed.url).ready


async def test_a_backend_failing_mid_stream_cuts_the_client_off(router, fake_backends) -> None:
    backend = await fake_backends()
    backend.die_after_tokens = 2
    async with router([backend.url]) as state, aiohttp.ClientSession() as session:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 10, "stream": True}
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(f"{state.url}/v1/completions", json=body) as response:
                assert response.status == 200
                await response.read()
        metrics = metric_samples(await (await session.get(f"{state.url}/metrics")).text())
    assert metrics[f"hpi:router_stream_failures_total{{backend={backend.url}}}"] == 1


async def test_own_endpoints_and_models_from_the_backends(router, fake_backends) -> None:
    a, b = await fake_backends(name="model-a"), await fake_backends(name="model-b")
    async with router([a.url, b.url]) as state, aiohttp.ClientSession() as session:
        assert (await session.get(f"{state.url}/health")).status == 200
        ready = await session.get(f"{state.url}/ready")
        assert ready.status == 200 and (await ready.json())["ready_backends"] == 2
        models = await (await session.get(f"{state.url}/v1/models")).json()
        assert sorted(card["id"] for card in models["data"]) == ["model-a", "model-b"]
        chat = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with session.post(f"{state.url}/v1/chat/completions", json=chat) as response:
            assert response.status == 200
            assert (await response.json())["choices"][0]["message"]["content"] == "tok tok tok "
        text = await (await session.get(f"{state.url}/metrics")).text()
    assert f'hpi:router_backend_ready{{backend="{a.url}"}} 1.0' in text
    assert "hpi:router_request_latency_seconds_bucket" in text


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (b"", 400, "empty"),
    (b'{"prompt": "' + b"x" * 70_000 + b'"}', 413, ""),
])
async def test_bad_input_gets_a_4xx_with_a_message(router, fake_backends, body, status, message) -> None:
    backend = await fake_backends()
    async with router([backend.url], max_request_body_bytes=64 * 1024) as state, aiohttp.ClientSession() as session:
        async with session.post(f"{state.url}/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as response:
            assert response.status == status
            error = (await response.json())["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
        async with session.get(f"{state.url}/v1/embeddings") as response:
            assert response.status == 404 and "no route" in (await response.json())["error"]["message"]
    assert backend.num_requests == 0


async def probe_passing_whatever_it_reads(session: aiohttp.ClientSession, pool, backend) -> None:
    """A deliberately wrong probe: any answer from /ready lets the backend back in."""
    async with session.get(f"{backend.url}/ready"):
        pool.restore(backend)


@pytest.mark.parametrize("broken", [False, True], ids=["router", "broken-probe-ignores-status"])
async def test_no_ready_backend_is_a_503(router, fake_backends, monkeypatch, broken) -> None:
    backend = await fake_backends()
    backend.ready = False
    if broken:
        monkeypatch.setattr(monitor, "_probe", probe_passing_whatever_it_reads)
    no_queue = QueueSettings(max_queued=0)  # with the queue (the default) it waits instead: test_router_queue.py
    async with router([backend.url], wait_ready=False, queue=no_queue) as state, aiohttp.ClientSession() as session:
        # Probed twice: the first probe's answer was read before the second was sent.
        assert await wait_until(lambda: backend.num_ready_probes >= 2)
        metrics = metric_samples(await (await session.get(f"{state.url}/metrics")).text())
        never_let_in = not metrics.get(f"hpi:router_ejections_total{{backend={backend.url}}}")  # in, then out
        router_ready = (await session.get(f"{state.url}/ready")).status
        status, text = await complete(session, state.url, "hi")
    if broken:
        with pytest.raises(AssertionError):
            assert never_let_in
        return
    assert never_let_in and router_ready == 503
    assert status == 503 and "no backend is ready" in json.loads(text)["error"]["message"]
