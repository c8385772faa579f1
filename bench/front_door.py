"""The front door's fairness: two tenants of equal weight, both asking for more than the fleet serves, one ten
times as hard; the share of completed requests each gets through `hpi-router` with its tenants and queue
(`--tenants-file`, `--queue-saturated-waiting 1`) against the router without them (today's default: every
request goes straight to an engine, whose queue serves first come first served).

The engines are fakes that behave like continuous-batching servers where it matters here: a fixed number of
slots (max_num_seqs), a waiting queue admitted by vLLM's request priority, one token per slot per step, and
vLLM's running/waiting gauges on /metrics, which the router reads. Fakes, not `hpi serve`, so that the figure is
the router's policy alone, exact and cheap on a 2-core machine (a real engine's share follows its slots the same
way). Everything runs in one process over loopback HTTP: the engines, the real router (hpi_router's app and
monitor), and closed-loop clients (each sends its next request when the last one ends).

    PYTHONPATH=.:contracts:router python -m bench.front_door          # -> bench/results/front_door.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web

from bench.fleet_sim.report import machine
from hpi_router.config import QueueSettings, RouterSettings
from hpi_router.main import running_router
from hpi_router.sources import StaticSource
from hpi_router.state import RouterState

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = {"heavy": "sk-heavy-0123456789abcdef", "light": "sk-light-0123456789abcdef"}


@dataclass
class FakeEngine:
    slots: int
    step_s: float
    running: int = 0
    waiting: list = field(default_factory=list)  # heap of (priority, arrival, future)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    async def admit(self, priority: int) -> None:
        if self.running < self.slots and not self.waiting:
            self.running += 1
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self.waiting, (priority, next(self._arrivals), future))
        await future

    def release(self) -> None:
        self.running -= 1
        while self.waiting and self.running < self.slots:
            _, _, future = heapq.heappop(self.waiting)
            if not future.done():
                self.running += 1
                future.set_result(None)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await self.admit(int(body.get("priority", 0)))
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            for i in range(int(body.get("max_tokens", 16))):
                await asyncio.sleep(self.step_s)
                if i == 0:
                    await response.prepare(request)
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.release()

    async def metrics(self, request: web.Request) -> web.Response:
        label = '{model_name="fake"}'
        text = (f"vllm:num_requests_running{label} {self.running}\nvllm:num_requests_waiting{label} "
                f"{len(self.waiting)}\nvllm:kv_cache_usage_perc{label} 0.1\nhpi:ready 1\n")  # fmt: skip
        return web.Response(text=text)

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/ready", lambda r: web.json_response({"status": "ready"}))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def client(session: aiohttp.ClientSession, url: str, tenant: str, tokens: int, until: float,
                 done: list[tuple[str, float]]) -> None:  # fmt: skip
    """Closed loop: one request at a time, the next as soon as the last one ends."""
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    body = {"model": "fake", "prompt": tenant, "max_tokens": tokens, "stream": True}
    while time.monotonic() < until:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            await response.read()
            if response.status == 200:
                done.append((tenant, time.monotonic()))


async def share_run(with_tenants: bool, args: argparse.Namespace) -> dict:
    engines = [FakeEngine(args.slots, args.step_ms / 1e3) for _ in range(args.engines)]
    started = [await e.start() for e in engines]
    urls = [url for _, url in started]
    with tempfile.TemporaryDirectory() as tmp:
        extra = {}
        if with_tenants:
            path = Path(tmp) / "tenants.yaml"
            path.write_text(yaml.safe_dump({"tenants": [{"name": n, "keys": [k]} for n, k in KEYS.items()]}))
            extra = {"tenants_file": str(path), "queue": QueueSettings(saturated_waiting=1)}
        state = RouterState(RouterSettings(backend_urls=tuple(urls), scrape_interval_s=0.05, probe_interval_s=0.1,
                                           **extra))  # fmt: skip
        async with running_router(state, [StaticSource(urls)], "127.0.0.1", 0) as port:
            url = f"http://127.0.0.1:{port}"
            while len(state.pool.ready()) < len(urls):
                await asyncio.sleep(0.02)
            done: list[tuple[str, float]] = []
            start = time.monotonic()
            until = start + args.warmup_s + args.seconds
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                loops = [client(session, url, "heavy", args.tokens, until, done) for _ in range(args.heavy_clients)]
                loops += [client(session, url, "light", args.tokens, until, done) for _ in range(args.light_clients)]
                await asyncio.gather(*loops)
    for runner, _ in started:
        await runner.cleanup()
    window = [t for t, at in done if start + args.warmup_s <= at <= until]  # the steady part, no drain
    counts = {t: window.count(t) for t in KEYS}
    total = sum(counts.values())
    capacity = args.engines * args.slots / (args.tokens * args.step_ms / 1e3)
    return {"router": "tenants + queue" if with_tenants else "no tenants (today's default)", "completed": counts,
            "share": {t: round(n / total, 4) for t, n in counts.items()},
            "requests_per_s": round(total / args.seconds, 2), "capacity_requests_per_s": round(capacity, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8, help="each engine's max_num_seqs")
    parser.add_argument("--step-ms", type=float, default=20.0, help="decode step time")
    parser.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--heavy-clients", type=int, default=100)
    parser.add_argument("--light-clients", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each router")
    args = parser.parse_args()
    runs = []
    for _ in range(args.rounds):
        for with_tenants in (False, True):
            runs.append(asyncio.run(share_run(with_tenants, args)))
            print(json.dumps(runs[-1]), flush=True)
    fair = [r["share"]["light"] for r in runs if r["router"].startswith("tenants")]
    blind = [r["share"]["light"] for r in runs if not r["router"].startswith("tenants")]
    out = {"machine": machine(), "settings": vars(args), "runs": runs, "light_share_with_tenants": fair,
           "light_share_without": blind, "target": "each tenant 50% +- 10% of the throughput",
           "met": all(0.4 <= s <= 0.6 for s in fair), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "front_door.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("light_share_with_tenants", "light_share_without", "met")}))


if __name__ == "__main__":
    main()
