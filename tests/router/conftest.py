"""Router fixtures: fake backends and an in-process router on loopback (the same event loop as the test).

`FakeBackend` is a small real aiohttp server that speaks what the router reads from an `hpi serve`
backend: /ready, /metrics (vLLM's names, rendered by the runtime's own ServingMetrics), /v1/models, and
/v1/completions + /v1/chat/completions (JSON or SSE) that "decode" one token per `token_delay_s` per request.

Used where only the routing (policy, failover, streaming plumbing) is under test: it starts in
milliseconds and its speed is exact, where real tiny-model servers take seconds each to start. The fake
renders its /metrics with the runtime's own ServingMetrics, so the router is tested against what real
backends write. `tiny_model_dir` is for the few tests with real `hpi serve` backends (test_real_backends.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from hpi_router.config import RouterSettings
from hpi_router.main import running_router
from hpi_router.sources import StaticSource
from hpi_router.state import RouterState
from hpi_runtime.core.engine_io import EngineStats
from hpi_runtime.server.metrics import ServingMetrics
from hpi_testing.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with a real tokenizer: what the real backends serve."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@dataclass
class BackendCounters:
    """What the fake backend counts; published as the runtime's own (frozen) EngineStats."""

    num_running: int = 0
    num_generation_tokens: int = 0

    def engine_stats(self) -> EngineStats:
        return EngineStats(num_running=self.num_running, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                           prefix_cache_hits=0, num_preemptions=0, num_prompt_tokens=0,
                           num_generation_tokens=self.num_generation_tokens)  # fmt: skip


class FakeBackend:
    def __init__(self, token_delay_s: float = 0.002, name: str = "fake-model"):
        self.token_delay_s = token_delay_s
        self.name = name
        self.ready = True
        self.fail_status: int | None = None  # answer every generation request with this status
        self.die_after_tokens: int | None = None  # drop the connection after this many streamed tokens
        self.max_model_len = 1_000_000  # max_tokens must be an integer in [1, this], as the runtime checks (400)
        self.adapters: set[str] | None = None  # LoRA adapters loaded: a request's model must be one or `name` (404)
        self.die_on_request = False  # a pod that dies on its first generation request: the connection drops, then
        # it stops listening (connections refused, probes fail)
        self.stats = BackendCounters()
        self.metrics = ServingMetrics(name)
        self.num_requests = 0
        self.num_cancelled = 0
        self.num_ready_probes = 0  # GETs of /ready (the router's probes of a backend out of rotation)
        self.prompts: list[str] = []
        self.bodies: list[dict] = []  # every generation request's JSON, in arrival order
        self.authorizations: list[str | None] = []  # the Authorization header each one came with
        self.in_flight_prompts: set[str] = set()  # the prompts of the requests it is generating now
        self._transports: set = set()  # those requests' connections (kill resets them)
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> FakeBackend:
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/health", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def kill(self) -> None:
        """Die as a crashed pod does: every connection reset at once, then nothing listens."""
        for transport in list(self._transports):
            transport.abort()
        await self.stop()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _ready(self, request: web.Request) -> web.Response:
        self.num_ready_probes += request.path == "/ready"
        return web.json_response({"status": "ready" if self.ready else "loading"}, status=200 if self.ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics.refresh(self.stats.engine_stats())
        self.metrics.set_ready(self.ready)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        prompt = body.get("prompt")
        if self.die_on_request:
            self.num_requests += 1
            request.transport.abort()
            asyncio.get_running_loop().create_task(self.stop())
            return web.Response()  # never sent: the connection is gone
        if self.fail_status is not None:
            return web.json_response({"error": {"message": "refused", "type": "x", "param": None, "code": None}},
                                     status=self.fail_status)
        if self.adapters is not None and body.get("model") not in {self.name, *self.adapters}:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                "type": "NotFoundError", "param": None, "code": 404}}, status=404)
        num_tokens = body.get("max_tokens") or 8
        if not isinstance(num_tokens, int) or not 1 <= num_tokens <= self.max_model_len:
            return web.json_response({"error": {"message": f"max_tokens must be in [1, {self.max_model_len}]",
                                                "type": "invalid_request_error", "param": "max_tokens", "code": None}},
                                     status=400)
        self.num_requests += 1
        self.prompts.append(json.dumps(body.get("prompt", body.get("messages"))))
        chat = request.path.endswith("/chat/completions")
        self.stats.num_running += 1
        self.in_flight_prompts.add(str(prompt))
        self._transports.add(request.transport)
        try:
            if not body.get("stream"):
                for _ in range(num_tokens):
                    await self._decode_one()
                return web.json_response(_completion(self.name, chat, "tok " * num_tokens, num_tokens))
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            for i in range(num_tokens):
                await self._decode_one()
                if i == 0:
                    await response.prepare(request)
                if self.die_after_tokens is not None and i >= self.die_after_tokens:
                    request.transport.abort()
                    return response
                await response.write(b"data: " + json.dumps(_chunk(self.name, chat, "tok ")).encode() + b"\n\n")
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):  # as the runtime: a usage-only chunk
                usage = {**_chunk(self.name, chat, ""), "choices": [], "usage": _usage(num_tokens)}
                await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        finally:
            self.stats.num_running -= 1
            self.in_flight_prompts.discard(str(prompt))
            self._transports.discard(request.transport)

    async def _decode_one(self) -> None:
        await asyncio.sleep(self.token_delay_s)
        self.stats.num_generation_tokens += 1


def _completion(model: str, chat: bool, text: str, num_tokens: int) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
              else {"index": 0, "text": text, "finish_reason": "length", "logprobs": None})
    return {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": _usage(num_tokens)}


def _usage(num_tokens: int) -> dict:
    return {"prompt_tokens": 1, "completion_tokens": num_tokens, "total_tokens": num_tokens + 1}


def _chunk(model: str, chat: bool, text: str) -> dict:
    choice = ({"index": 0, "delta": {"content": text}, "finish_reason": None} if chat
              else {"index": 0, "text": text, "finish_reason": None, "logprobs": None})
    return {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}



@contextlib.contextmanager
def _real_backends(model_dir: Path, log_dir: Path, names: tuple[str, ...], *args: str):
    """`hpi serve` backends on `model_dir`, started side by side (their loads overlap), stopped at the end."""
    from hpi_testing.server import RuntimeServer

    started = [RuntimeServer(model_dir, log_dir / f"{name}.log", *args, wait_ready=False) for name in names]
    try:
        for server in started:
            server.wait_ready()
        yield started
    finally:
        for server in started:
            server.stop()


@contextlib.asynccontextmanager
async def router_for(urls, wait_ready: bool = True, **settings):
    """A router over `urls`, serving on a free port; waits until every backend has been probed ready."""
    state = RouterState(RouterSettings(backend_urls=tuple(urls), **{"scrape_interval_s": 0.05,
                                                                     "probe_interval_s": 0.1, **settings}))
    async with running_router(state, [StaticSource(urls)], "127.0.0.1", 0) as port:
        state.url = f"http://127.0.0.1:{port}"
        for _ in range(200 if wait_ready else 0):
            if len(state.pool.ready()) == len(urls):
                break
            await asyncio.sleep(0.02)
        yield state


@pytest.fixture(scope="session")
def real_backends():
    """`with real_backends(model_dir, log_dir, names, *serve_args) as servers:` real `hpi serve` backends."""
    return _real_backends


@pytest.fixture()
def router():
    """`async with router(urls, **settings) as state:` a router over urls; `state.url` is its base URL."""
    return router_for


@pytest.fixture()
async def fake_backends():
    """A factory of started FakeBackends, all stopped at the end of the test."""
    started: list[FakeBackend] = []

    async def make(**kwargs) -> FakeBackend:
        backend = await FakeBackend(**kwargs).start()
        started.append(backend)
        return backend

    yield make
    for backend in started:
        await backend.stop()
