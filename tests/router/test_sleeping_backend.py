"""A sleeping runtime pod (POST /sleep) receives no traffic through the router: two real `hpi serve` backends
(the tiny random model, its core in its own process, so the sleep messages cross the process boundary), one
put to sleep at level 2 and woken again.

Requests sent the moment it falls asleep, before the router has scraped it, get its 503 and are retried on the
other backend (the client sees 200); once the router has seen hpi:ready 0 it forwards nothing there; after
/wake_up it answers the same greedy completion as before and takes traffic again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from hpi_testing.server import metric_samples

pytestmark = pytest.mark.slow
SERVED_NAME = "tiny-llama"
SERVER_ARGS = ("--served-model-name", SERVED_NAME, "--max-model-len", "256", "--max-num-seqs", "8",
               "--kv-cache-memory", "8MiB", "--dtype", "float32")
BODY = {"model": SERVED_NAME, "prompt": "one two three four", "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, real_backends):
    with real_backends(tiny_model_dir, tmp_path_factory.mktemp("backends"), ("awake", "sleeper"),
                       *SERVER_ARGS) as started:  # fmt: skip
        yield started


async def _post(session: aiohttp.ClientSession, url: str, body: dict | None = None) -> tuple[int, dict]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


async def _until(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


def _forwarded(state, backend_url: str) -> float:
    samples = metric_samples(state.metrics.render().decode())
    return sum(v for k, v in samples.items() if k.startswith("hpi:router_requests_total") and backend_url in k)


async def test_a_sleeping_backend_gets_no_traffic_and_serves_the_same_after_waking(servers, router) -> None:
    awake, sleeper = servers
    async with router([awake.base_url, sleeper.base_url], scrape_interval_s=0.1) as state, \
            aiohttp.ClientSession() as session:
        status, before = await _post(session, f"{sleeper.base_url}/v1/completions", BODY)
        assert status == 200, before

        status, slept = await _post(session, f"{sleeper.base_url}/sleep?level=2")
        assert status == 200 and slept["freed_bytes"] > 0, slept
        # At once, before any scrape: whatever lands on the sleeper is its 503, retried on the other backend.
        answers = await asyncio.gather(*(_post(session, f"{state.url}/v1/completions", BODY) for _ in range(8)))
        assert [status for status, _ in answers] == [200] * 8, answers

        await _until(lambda: not state.pool.get(sleeper.base_url).ready, "the router sees the sleeper not ready")
        forwarded = _forwarded(state, sleeper.base_url)
        answers = await asyncio.gather(*(_post(session, f"{state.url}/v1/completions", BODY) for _ in range(8)))
        assert [status for status, _ in answers] == [200] * 8, answers
        assert _forwarded(state, sleeper.base_url) == forwarded  # never routed there

        status, woken = await _post(session, f"{sleeper.base_url}/wake_up")
        assert status == 200 and woken["restored_bytes"] == slept["freed_bytes"], woken
        status, after = await _post(session, f"{sleeper.base_url}/v1/completions", BODY)
        assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
        await _until(lambda: state.pool.get(sleeper.base_url).ready, "the router lets the woken backend back in")
