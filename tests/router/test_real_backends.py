"""The router in front of real `hpi serve` backends (the tiny random model, eager) on loopback: the official
openai client through `hpi-router` (the CLI, as a subprocess), streaming, /v1/models; and a backend killed
mid-run, in which no request fails that had not started streaming."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from hpi_testing.server import free_port, metric_samples

pytestmark = pytest.mark.slow
SERVED_NAME = "tiny-llama"
SERVER_ARGS = ("--served-model-name", SERVED_NAME, "--max-model-len", "512", "--max-num-seqs", "16",
               "--kv-cache-memory", "16MiB", "--dtype", "float32", "--enforce-eager")


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, real_backends):
    """Two backends, started together. The failover test, last in this file, kills the second."""
    with real_backends(tiny_model_dir, tmp_path_factory.mktemp("backends"), ("a", "b"), *SERVER_ARGS) as started:
        yield started


@pytest.fixture(scope="module")
def router_url(servers, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "wb")
    argv = [sys.executable, "-m", "hpi_router.cli", "--port", str(port), "--scrape-interval", "0.1",
            "--probe-interval", "0.2", *(arg for b in servers for arg in ("--backend", b.base_url))]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert process.poll() is None, "hpi-router exited"
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                    if json.loads(response.read())["ready_backends"] == 2:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        assert process.wait(30) == 0  # SIGTERM: drains and exits 0
        log.close()


def test_openai_client_through_the_router(router_url: str) -> None:
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    completion = client.completions.create(model=SERVED_NAME, prompt="The capital of France is", max_tokens=8,
                                           temperature=0.0)
    assert completion.usage.completion_tokens > 0 and completion.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=8, temperature=0.0)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=8, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 8 and text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the backend's own 400 passes through
        client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=-1)


async def _one(session: aiohttp.ClientSession, url: str, i: int, stream: bool) -> dict:
    body = {"model": SERVED_NAME, "prompt": f"request {i}: one two three", "max_tokens": 96, "ignore_eos": True,
            "temperature": 0.0, "stream": stream}
    outcome = {"stream": stream, "started": False, "ok": False, "error": None}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                outcome["error"] = f"HTTP {response.status}: {await response.text()}"
                return outcome
            if not stream:
                outcome["ok"] = (await response.json())["usage"]["completion_tokens"] == 96
                return outcome
            async for line in response.content:
                if line.startswith(b"data: {"):
                    outcome["started"] = True
                elif line.startswith(b"data: [DONE]"):
                    outcome["ok"] = True
    except aiohttp.ClientError as exc:
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    return outcome


async def test_a_backend_killed_mid_run_fails_no_request_that_had_not_started_streaming(
        servers, router) -> None:
    survivor, victim = servers
    async with router([survivor.base_url, victim.base_url], scrape_interval_s=0.1) as state, \
            aiohttp.ClientSession() as session:
        queue = [(i, i % 2 == 0) for i in range(16)]
        outcomes: list[dict] = []

        async def client() -> None:
            while queue:
                i, stream = queue.pop()
                outcomes.append(await _one(session, state.url, i, stream))

        load = asyncio.gather(*(client() for _ in range(8)))
        deadline = time.monotonic() + 60
        while state.pool.get(victim.base_url).in_flight < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        in_flight_at_kill = state.pool.get(victim.base_url).in_flight
        victim.kill()
        await load
        assert not state.pool.get(victim.base_url).ready
        samples = metric_samples(state.metrics.render().decode())
    cut_off = sum(v for k, v in samples.items() if k.startswith("hpi:router_stream_failures_total")
                  and victim.base_url in k)
    retried = sum(v for k, v in samples.items() if k.startswith("hpi:router_retries_total") and victim.base_url in k)
    assert cut_off + retried >= 1  # the kill hit requests: each was retried or (streaming already) cut off
    assert cut_off == sum(not o["ok"] for o in outcomes)
    assert in_flight_at_kill >= 2
    assert len(outcomes) == 16
    failed = [o for o in outcomes if not o["ok"]]
    assert all(o["stream"] and o["started"] for o in failed), failed
    assert all(o["ok"] for o in outcomes if not o["stream"])
