"""The front door's fairness, two figures through `hpi-router` with its tenants and queue against the router
without them (today's default: every request goes straight to an engine, whose queue serves first come first
served):
- shares: two tenants of equal weight, both asking for more than the fleet serves, one ten times as hard: the
  share of completed requests each gets (`--tenants-file`, `--queue-saturated-waiting 1`);
- urgency: an interactive tenant (priority -1, one client) while a batch tenant saturates the fleet: its p90 time
  to first token against its own unloaded p90 (the same, plus `--queue-reserved-slots 2`).

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
KEYS = {"heavy": "sk-heavy-0123456789abcdef", "light": "sk-light-0123456789abcdef",
        "interactive": "sk-inter-0123456789abcdef", "batch": "sk-batch-0123456789abcdef"}
PRIORITY = {"interactive": -1}


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
        label, source = '{model_name="fake"}', '{source="assumed"}'
        text = (f"vllm:num_requests_running{label} {self.running}\nvllm:num_requests_waiting{label} "
                f"{len(self.waiting)}\nvllm:kv_cache_usage_perc{label} 0.1\nhpi:ready 1\n"
                f"hpi:profile_itl_alpha_seconds{source} {self.step_s}\nhpi:profile_itl_beta_seconds{source} 0\n"
                f"hpi:profile_prefill_tokens_per_second{source} 100000\n"
                f"hpi:profile_max_num_seqs{source} {self.slots}\n")  # its pool profile, as `hpi serve --pool-profile`
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
                 done: list[tuple[str, float]], ttfts: list[float] | None = None,
                 think_s: float = 0.0) -> None:  # fmt: skip
    """Closed loop: one request at a time, the next `think_s` after the last one ends; `ttfts`: each request's
    time to its first streamed bytes."""
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    body = {"model": "fake", "prompt": tenant, "max_tokens": tokens, "stream": True}
    while time.monotonic() < until:
        sent = time.monotonic()
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            first = await response.content.readany()
            if ttfts is not None and response.status == 200 and first:
                ttfts.append(time.monotonic() - sent)
            await response.read()
            if response.status == 200:
                done.append((tenant, time.monotonic()))
        await asyncio.sleep(think_s)


def _tenants_file(directory: str) -> str:
    path = Path(directory) / "tenants.yaml"
    tenants = [{"name": n, "keys": [k], "priority": PRIORITY.get(n, 0)} for n, k in KEYS.items()]
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return str(path)


async def _fleet_run(args: argparse.Namespace, queue: QueueSettings | None, clients) -> tuple[list, float, float]:
    """Start the engines and the router (with tenants and `queue`, or as by default when None), run `clients(
    session, url, until, done)` for warm-up + the measured seconds; (done, window start, window end)."""
    engines = [FakeEngine(args.slots, args.step_ms / 1e3) for _ in range(args.engines)]
    started = [await e.start() for e in engines]
    urls = [url for _, url in started]
    with tempfile.TemporaryDirectory() as tmp:
        extra = {} if queue is None else {"tenants_file": _tenants_file(tmp), "queue": queue}
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
                await asyncio.gather(*clients(session, url, until, done))
    for runner, _ in started:
        await runner.cleanup()
    return done, start + args.warmup_s, until


async def share_run(with_tenants: bool, args: argparse.Namespace) -> dict:
    def clients(session, url, until, done):
        loops = [client(session, url, "heavy", args.tokens, until, done) for _ in range(args.heavy_clients)]
        return loops + [client(session, url, "light", args.tokens, until, done) for _ in range(args.light_clients)]

    done, start, until = await _fleet_run(args, QueueSettings(saturated_waiting=1) if with_tenants else None,
                                          clients)  # fmt: skip
    window = [t for t, at in done if start <= at <= until]  # the steady part, no drain
    counts = {t: window.count(t) for t in ("heavy", "light")}
    total = sum(counts.values())
    capacity = args.engines * args.slots / (args.tokens * args.step_ms / 1e3)
    return {"router": "tenants + queue" if with_tenants else "no tenants (today's default)", "completed": counts,
            "share": {t: round(n / total, 4) for t, n in counts.items()},
            "requests_per_s": round(total / args.seconds, 2), "capacity_requests_per_s": round(capacity, 2)}


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(int(0.9 * len(ordered) + 0.5) - 1, 0)]


async def urgency_run(router: str, args: argparse.Namespace) -> dict:
    """`router`: unloaded (the interactive tenant alone, tenants + queue), loaded (with a saturating batch tenant,
    tenants + queue + reserved slots), loaded-default (the same load through the router as by default)."""
    ttfts: list[float] = []
    queue = {"loaded-default": None, "unloaded": QueueSettings(saturated_waiting=1)}.get(
        router, QueueSettings(saturated_waiting=1, reserved_slots=args.reserved_slots))  # fmt: skip

    def clients(session, url, until, done):
        loops = [client(session, url, "interactive", args.tokens, until, done, ttfts, think_s=0.1)]
        if router != "unloaded":
            loops += [client(session, url, "batch", args.tokens, until, done) for _ in range(args.heavy_clients)]
        return loops

    await _fleet_run(args, queue, clients)
    measured = ttfts[int(len(ttfts) * args.warmup_s / (args.warmup_s + args.seconds)):]
    median = sorted(measured)[len(measured) // 2]
    return {"router": router, "interactive_requests": len(measured), "ttft_p50_ms": round(1e3 * median, 1),
            "ttft_p90_ms": round(1e3 * p90(measured), 1)}


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
    parser.add_argument("--reserved-slots", type=int, default=2, help="urgency: the router's --queue-reserved-slots")
    parser.add_argument("--sections", nargs="+", default=["shares", "urgency"], choices=["shares", "urgency"])
    args = parser.parse_args()
    out: dict = {"machine": machine(), "settings": vars(args)}
    path = RESULTS / "front_door.json"
    if path.exists() and set(args.sections) != {"shares", "urgency"}:  # a partial run updates its part
        out = {**json.loads(path.read_text()), **out}
    if "shares" in args.sections:
        runs = []
        for _ in range(args.rounds):
            for with_tenants in (False, True):
                runs.append(asyncio.run(share_run(with_tenants, args)))
                print(json.dumps(runs[-1]), flush=True)
        fair = [r["share"]["light"] for r in runs if r["router"].startswith("tenants")]
        blind = [r["share"]["light"] for r in runs if not r["router"].startswith("tenants")]
        out["shares"] = {"runs": runs, "light_share_with_tenants": fair, "light_share_without": blind,
                         "target": "each tenant 50% +- 10% of the throughput",
                         "met": all(0.4 <= s <= 0.6 for s in fair)}
    if "urgency" in args.sections:
        runs = []
        for _ in range(args.rounds):
            for router in ("unloaded", "loaded", "loaded-default"):
                runs.append(asyncio.run(urgency_run(router, args)))
                print(json.dumps(runs[-1]), flush=True)
        unloaded = [r["ttft_p90_ms"] for r in runs if r["router"] == "unloaded"]
        loaded = [r["ttft_p90_ms"] for r in runs if r["router"] == "loaded"]
        ratios = [round(b / a, 2) for a, b in zip(unloaded, loaded, strict=True)]
        out["urgency"] = {"runs": runs, "ratio_loaded_over_unloaded": ratios,
                          "target": "interactive p90 TTFT within 2x of unloaded while a batch tenant saturates",
                          "met": all(r <= 2 for r in ratios)}
    out["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    summary = {k: {kk: v for kk, v in out[k].items() if kk != "runs"} for k in ("shares", "urgency") if k in out}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
