"""Sleep mode (vLLM's /sleep, /wake_up, /is_sleeping) on a real loopback server over a real compiled engine.

The engine core runs in a thread of this process (ThreadCoreClient) so that the tests can look at the
executor's tensors: what the answers claim to free must leave those tensors' storages, and come back.
tests/runtime/server/test_sleep_process.py runs the same round trip through `hpi serve` (the core process).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from aiohttp import web

from hpi_runtime.config import EngineArgs
from hpi_runtime.core.engine_io import Sleep
from hpi_runtime.engine_factory import create_engine
from hpi_runtime.frontend.async_engine import AsyncLLM
from hpi_runtime.server.app import build_app
from hpi_runtime.server.state import ServedModel, ServerSettings, ServerState
from hpi_runtime.worker.sleep import model_storage_bytes
from hpi_testing.server import free_port, metric_samples
from hpi_testing.server import post_json as post

NAME = "tiny-llama"
# Longer than a few 16-token blocks: the second run of it would hit the prefix cache if sleep kept the hashes
# of blocks whose KV it freed (and read zeros).
PROMPT = "The quick brown fox jumps over the lazy dog; " * 2


class LoopbackServer:
    """build_app over an AsyncLLM with its core in a thread; its event loop runs in a thread of its own, so the
    tests talk to it over HTTP from the test thread (and from helper threads, to overlap requests)."""

    def __init__(self, model_dir: Path) -> None:
        args = EngineArgs.from_options(model=str(model_dir), dtype="float32", max_model_len=128,
                                       kv_cache_memory_bytes=1 << 20)  # fmt: skip
        bundle = create_engine(args)
        self.core = bundle.engine.core
        self.executor = self.core.executor
        tokenizer = bundle.resolved.tokenizer
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.engine = AsyncLLM.in_thread(self.core, tokenizer)
        self.state = ServerState(ServerSettings(served_model_name=NAME))
        served = ServedModel(self.engine, tokenizer, NAME, 128, min(len(tokenizer), bundle.resolved.vocab_size))
        self.runner = self.run(self._start(served))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    async def _start(self, served: ServedModel) -> web.AppRunner:
        await self.engine.start()
        self.state.set_model(served)
        runner = web.AppRunner(build_app(self.state))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.engine.shutdown()

    def close(self) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)

    def get(self, path: str) -> tuple[int, object]:
        try:
            with urllib.request.urlopen(f"{self.base_url}{path}", timeout=60) as response:
                body = response.read()
                status = response.status
        except urllib.error.HTTPError as exc:
            body, status = exc.read(), exc.code
        return status, json.loads(body) if path != "/metrics" else body.decode()

    def complete(self) -> tuple[int, dict]:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        return post(self.base_url, "/v1/completions", body)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    running = LoopbackServer(tiny_model_dir)
    assert running.executor.runner.is_compiled  # the compiled step must survive the storage swaps
    yield running
    running.close()


def _text(answer: tuple[int, dict]) -> str:
    status, body = answer
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.mark.parametrize("level", [1, 2])
def test_round_trip_frees_what_it_claims_and_keeps_greedy_output(server: LoopbackServer, level: int) -> None:
    before_text = _text(server.complete())
    model = server.executor.model
    tensor_ids = [id(t) for t in (*model.parameters(), *model.buffers())]
    weight_bytes, kv_bytes = model_storage_bytes(model)
    assert weight_bytes > 0 and kv_bytes > 0

    status, slept = post(server.base_url, f"/sleep?level={level}", b"")
    assert status == 200, slept
    asleep_weight_bytes, asleep_kv_bytes = model_storage_bytes(model)
    assert asleep_kv_bytes == 0
    # On CPU level 1 keeps the weights (they are in host memory already); level 2 frees them.
    assert asleep_weight_bytes == (weight_bytes if level == 1 else 0)
    assert slept["freed_bytes"] == weight_bytes + kv_bytes - asleep_weight_bytes
    assert slept["is_sleeping"] is True and slept["level"] == level
    assert not server.core.kv_cache_manager.pool.cached_blocks  # the prefix cache forgot the freed KV
    # Hold the freed memory with NaNs, so a wake that skipped restoring could not pass on bytes left behind.
    junk = torch.full((slept["freed_bytes"] // 4,), float("nan"))

    status, woken = post(server.base_url, "/wake_up", b"")
    del junk
    assert status == 200, woken
    assert woken["restored_bytes"] == slept["freed_bytes"] and woken["is_sleeping"] is False
    assert model_storage_bytes(model) == (weight_bytes, kv_bytes)
    assert [id(t) for t in (*model.parameters(), *model.buffers())] == tensor_ids
    assert _text(server.complete()) == before_text


def test_a_sleeping_replica_is_not_ready_and_refuses_requests(server: LoopbackServer) -> None:
    assert server.get("/is_sleeping") == (200, {"is_sleeping": False})
    assert post(server.base_url, "/sleep", b"")[0] == 200  # level 1 by default
    try:
        assert server.get("/is_sleeping") == (200, {"is_sleeping": True})
        status, body = server.complete()
        assert status == 503 and body["error"]["code"] == "sleeping", body
        assert server.get("/ready") == (503, {"status": "sleeping"})
        assert server.get("/health")[0] == 200
        samples = metric_samples(server.get("/metrics")[1])
        assert samples["hpi:ready"] == 0 and samples["hpi:sleeping"] == 1
    finally:
        assert post(server.base_url, "/wake_up", b"")[0] == 200
    assert server.get("/ready") == (200, {"status": "ready"})
    samples = metric_samples(server.get("/metrics")[1])
    assert samples["hpi:ready"] == 1 and samples["hpi:sleeping"] == 0
    assert server.complete()[0] == 200


def test_sleep_and_wake_are_idempotent(server: LoopbackServer) -> None:
    assert post(server.base_url, "/wake_up", b"") == (200, {"is_sleeping": False, "level": 0, "restored_bytes": 0,
                                                            "seconds": 0.0})  # fmt: skip
    status, first = post(server.base_url, "/sleep?level=2", b"")
    assert status == 200 and first["freed_bytes"] > 0
    status, again = post(server.base_url, "/sleep?level=1", b"")
    assert status == 200 and again["freed_bytes"] == 0 and again["level"] == 2  # still the first sleep's level
    status, woken = post(server.base_url, "/wake_up", b"")
    assert status == 200 and woken["restored_bytes"] == first["freed_bytes"]
    assert post(server.base_url, "/wake_up", b"")[1]["restored_bytes"] == 0


@pytest.mark.parametrize("query", ["level=3", "level=0", "level=deep", "level="])
def test_a_bad_level_is_a_400(server: LoopbackServer, query: str) -> None:
    status, body = post(server.base_url, f"/sleep?{query}", b"")
    assert status == 400 and body["error"]["param"] == "level", body
    assert server.get("/is_sleeping") == (200, {"is_sleeping": False})


def test_sleep_while_a_request_runs_is_a_409_and_the_request_finishes(
    server: LoopbackServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hold the core inside a step of the request until the Sleep message is on its way, so the core sees it
    # while the request still runs, whatever the machine's speed.
    in_step, sleep_sent = threading.Event(), threading.Event()
    execute_model, send = server.executor.execute_model, server.engine.client.send

    def held_step(scheduler_output):
        in_step.set()
        assert sleep_sent.wait(60)
        return execute_model(scheduler_output)

    def watched_send(message) -> None:
        send(message)
        if isinstance(message, Sleep):
            sleep_sent.set()

    monkeypatch.setattr(server.executor, "execute_model", held_step)
    monkeypatch.setattr(server.engine.client, "send", watched_send)
    results: dict = {}
    request = threading.Thread(target=lambda: results.update(answer=server.complete()))
    request.start()
    assert in_step.wait(60)
    status, body = post(server.base_url, "/sleep?level=2", b"")
    request.join(60)
    assert status == 409 and body["error"]["code"] == "engine_busy", body
    assert "not idle" in body["error"]["message"]
    assert results["answer"][0] == 200  # the request was not disturbed
    assert server.get("/is_sleeping") == (200, {"is_sleeping": False})
