"""`hpi-router` against round-robin on a mixed fleet, prefix affinity's cache-hit gain, the router's own cost.

Four parts, written to bench/results/router.json (+ a Markdown summary printed for bench/results/router.md):
1. Mixed fleet: three local `hpi serve` backends of different speed on the embedded model, the same closed-loop
   workload (bench/loadgen.py) through `hpi-router --strategy round-robin` (what a plain Service does, per
   request), through `hpi-router` with affinity off, and with its defaults (affinity on), in rounds that
   alternate between the three: throughput, TTFT and end-to-end p50/p99, and how many requests each backend
   took.
2. Prefix cache: a workload of several long system prompts, each shared by a few requests, through round-robin,
   the router with affinity off, and with affinity on; the fleet's hit rate (sum of the backends'
   vllm:prefix_cache_hits / queries over the run). Each run uses its own system prompts (cold caches).
3. Overhead: a trivially fast fake backend (its own process) called directly and through the router at
   concurrency 1 (added latency per request), then at concurrency 32 (requests/s, and the router process's
   CPU seconds per request read from /proc: requests per core-second, which survives a noisy machine).
4. Pick cost (in process, no servers): one request's routing work (pick, start, finish) at 10, 100 and 1,000
   backends, the scan as the router did it at 3c2a292 (a view of every backend, the ring's full order, the
   median per request: policy.pick) against the pool's index (BackendPool.choose + started + finished), in
   alternating blocks in the same process so the machine's swings fall on both; and the once-per-round
   rescale the index needs instead.

    .venv/bin/python -m bench.bench_router                 # modest sizes, ~5-10 min on 2 busy cores
    .venv/bin/python -m bench.bench_router --quick         # a smoke run
    .venv/bin/python -m bench.bench_router --sections pick # part 4 alone, ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.loadgen import (
    LengthDist,
    LoadConfig,
    RequestSpec,
    RunResult,
    WorkloadSpec,
    build_requests,
    run_load,
    summarize,
)
from bench.systems import SERVED_MODEL_NAME, ServerCommand, ServerProcess, free_port, hpi_command, metric_value

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Backend:
    name: str
    num_threads: int
    args: tuple[str, ...]
    prefix: tuple[str, ...]  # command to run `hpi serve` under (nice)


# One torch thread each (3 backends + router + load generator already oversubscribe 2 cores). Two ways to make
# the third backend the weak one:
# - "batch1": a small pool, at most 1 request in its batch (what is sent beyond that waits): its capacity is
#   a fraction of the others' whatever they do;
# - "nice": at most 2 requests in its batch and `nice 10`, so on the oversubscribed cores it gets a smaller
#   share of CPU per step. Its speed then depends on the load on the other two (they take its CPU), which no
#   router can see coming; kept to show that (bench/results/router.md).
FLEETS = {
    "batch1": (Backend("fast-a", 1, (), ()), Backend("fast-b", 1, (), ()),
               Backend("slow", 1, ("--max-num-seqs", "1"), ())),
    "nice": (Backend("fast-a", 1, (), ()), Backend("fast-b", 1, (), ()),
             Backend("slow", 1, ("--max-num-seqs", "2"), ("nice", "-n", "10"))),
}


@dataclass(frozen=True)
class Plan:
    concurrency: int = 12
    num_requests: int = 48
    rounds: int = 3  # the fleet's requests in this many rounds, alternating between the routings
    prompt_len: int = 64
    output_len: int = 32
    kv_cache_memory: str = "64MiB"
    num_prefixes: int = 8
    requests_per_prefix: int = 4
    prefix_len: int = 192
    unique_len: int = 16
    prefix_output_len: int = 8
    prefix_concurrency: int = 4
    overhead_requests: int = 300
    overhead_concurrency: int = 32
    overhead_throughput_requests: int = 2000
    seed: int = 0


QUICK = Plan(concurrency=6, num_requests=12, rounds=2, output_len=8, num_prefixes=3, requests_per_prefix=2,
             prefix_len=64, overhead_requests=50, overhead_throughput_requests=200)


# -- processes ----------------------------------------------------------------------------------------------------


def router_command(backend_urls: list[str], *extra: str) -> ServerCommand:
    port = free_port()
    argv = (sys.executable, "-m", "hpi_router.cli", "--port", str(port), "--log-level", "warning",
            *(arg for url in backend_urls for arg in ("--backend", url)), *extra)
    return ServerCommand("hpi-router", argv, "/ready", port)


def wait_all_ready(base_url: str, num_backends: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/ready", timeout=2) as response:
                if json.loads(response.read()).get("ready_backends") == num_backends:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the router at {base_url} did not see {num_backends} ready backends")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def per_backend(router_url: str, name: str, urls: dict[str, str]) -> dict[str, float]:
    """A router counter, per backend name (summed over its other labels)."""
    text = get_text(f"{router_url}/metrics")
    return {label: metric_value_with(text, name, f'backend="{url}"') for label, url in urls.items()}


def metric_value_with(text: str, name: str, label: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


# -- 1. mixed fleet -----------------------------------------------------------------------------------------------


ROUTINGS = (("round_robin", ("--strategy", "round-robin")), ("router_no_affinity", ("--affinity-prefix-chars", "0")),
            ("router", ()))


def mixed_fleet(plan: Plan, tokenizer, backend_urls: dict[str, str], log_dir: Path, progress) -> dict:
    """Every routing gets the same requests, in `plan.rounds` rounds that alternate between routings (all routers
    run at once, over the same backends, only one under load at a time): on a shared, noisy machine the
    load from elsewhere then falls on all of them alike instead of on whichever ran last."""
    spec = WorkloadSpec(plan.num_requests, LengthDist(plan.prompt_len), LengthDist(plan.output_len), plan.seed)
    requests = build_requests(tokenizer, spec)
    # Warm-up at the measured concurrency: each router is measured in its steady state, with speeds learnt
    # under this load.
    warm = build_requests(tokenizer, WorkloadSpec(plan.concurrency, LengthDist(plan.prompt_len), LengthDist(16),
                                                  seed=plan.seed + 7))
    per_round = -(-len(requests) // plan.rounds)
    with ExitStack() as stack:
        routers = {label: stack.enter_context(ServerProcess(router_command(list(backend_urls.values()), *args),
                                                            log_dir / f"router-{label}.log"))
                   for label, args in ROUTINGS}
        runs: dict[str, list] = {label: [] for label in routers}
        before = {}
        for label, router in routers.items():
            wait_all_ready(router.base_url, len(backend_urls))
            asyncio.run(run_load(warm, LoadConfig(router.base_url, SERVED_MODEL_NAME, concurrency=plan.concurrency)))
            before[label] = per_backend(router.base_url, "hpi:router_requests_total", backend_urls)
        for start in range(0, len(requests), per_round):
            for label, router in routers.items():
                config = LoadConfig(router.base_url, SERVED_MODEL_NAME, concurrency=plan.concurrency)
                runs[label].append(asyncio.run(run_load(requests[start:start + per_round], config)))
        out = {}
        for label, router in routers.items():
            after = per_backend(router.base_url, "hpi:router_requests_total", backend_urls)
            speeds = per_backend(router.base_url, "hpi:router_backend_decode_speed", backend_urls)
            merged = RunResult(runs[label][0].config, sum(r.duration_s for r in runs[label]),
                               tuple(x for r in runs[label] for x in r.results))
            summary = summarize(merged)
            summary.pop("samples")
            summary["requests_per_backend"] = {n: int(after[n] - before[label][n]) for n in backend_urls}
            summary["decode_speed_tokens_per_s"] = {n: round(v, 1) for n, v in speeds.items()}
            out[label] = summary
            progress(f"{label}: {summary['output_tokens_per_s']:.1f} tok/s, e2e p50 {summary['e2e_ms']['p50']:.0f} ms "
                     f"p99 {summary['e2e_ms']['p99']:.0f} ms, errors {summary['num_errors']}, "
                     f"per backend {summary['requests_per_backend']}")
    rr, rt = out["round_robin"], out["router"]
    out["p99_e2e_ratio_rr_over_router"] = rr["e2e_ms"]["p99"] / rt["e2e_ms"]["p99"]
    out["p99_ttft_ratio_rr_over_router"] = rr["ttft_ms"]["p99"] / rt["ttft_ms"]["p99"]
    out["throughput_ratio_router_over_rr"] = rt["output_tokens_per_s"] / rr["output_tokens_per_s"]
    return out


# -- 2. prefix cache ----------------------------------------------------------------------------------------------


def prefix_requests(plan: Plan, tokenizer, seed: int) -> list[RequestSpec]:
    """`num_prefixes` system prompts, each opening `requests_per_prefix` requests, shuffled."""
    requests = []
    for p in range(plan.num_prefixes):
        spec = WorkloadSpec(plan.requests_per_prefix, LengthDist(plan.unique_len), LengthDist(plan.prefix_output_len),
                            seed=seed * 1000 + p, shared_prefix_len=plan.prefix_len)
        requests += build_requests(tokenizer, spec)
    random.Random(seed).shuffle(requests)
    return requests


def fleet_prefix_counters(backend_urls: dict[str, str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in backend_urls.values():
        text = get_text(f"{url}/metrics")
        hits += metric_value(text, "vllm:prefix_cache_hits_total")
        queries += metric_value(text, "vllm:prefix_cache_queries_total")
    return hits, queries


def prefix_affinity(plan: Plan, tokenizer, backend_urls: dict[str, str], log_dir: Path, progress) -> dict:
    out = {}
    configs = (("round_robin", ("--strategy", "round-robin")), ("load_no_affinity", ("--affinity-prefix-chars", "0")),
               ("load_with_affinity", ()))
    for index, (label, args) in enumerate(configs):
        requests = prefix_requests(plan, tokenizer, seed=plan.seed + 100 + index)  # fresh prompts: cold caches
        command = router_command(list(backend_urls.values()), *args)
        with ServerProcess(command, log_dir / f"router-{label}.log") as router:
            wait_all_ready(router.base_url, len(backend_urls))
            hits0, queries0 = fleet_prefix_counters(backend_urls)
            summary = summarize(asyncio.run(run_load(requests, LoadConfig(router.base_url, SERVED_MODEL_NAME,
                                                                          concurrency=plan.prefix_concurrency))))
            hits1, queries1 = fleet_prefix_counters(backend_urls)
            text = get_text(f"{router.base_url}/metrics")
        picks = {reason: metric_value_with(text, "hpi:router_picks_total", f'reason="{reason}"')
                 for reason in ("affinity", "load", "round_robin")}
        out[label] = {"hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0), "num_errors": summary["num_errors"],
                      "ttft_ms": summary["ttft_ms"], "output_tokens_per_s": summary["output_tokens_per_s"],
                      "picks_by_reason": {k: int(v) for k, v in picks.items() if v}}
        progress(f"prefix {label}: hit rate {out[label]['hit_rate']:.2f}, TTFT p50 {summary['ttft_ms']['p50']:.0f} ms, "
                 f"picks {out[label]['picks_by_reason']}")
    # The best any placement can do: every system prompt prefilled once, its full blocks reused by the others.
    block = 16
    cached_per_hit = plan.prefix_len // block * block
    total_prompt = plan.num_prefixes * plan.requests_per_prefix * (plan.prefix_len + plan.unique_len)
    out["ideal_hit_rate"] = plan.num_prefixes * (plan.requests_per_prefix - 1) * cached_per_hit / total_prompt
    return out


# -- 3. overhead --------------------------------------------------------------------------------------------------


def fake_backend_main(port: int) -> None:
    """A backend that answers at once: /ready, /metrics (empty), /v1/completions (JSON, or SSE of
    `max_tokens` chunks + usage)."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 4)
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                                      "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(n):
            choice = {"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}
            await response.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def overhead(plan: Plan, log_dir: Path, progress) -> dict:
    port = free_port()
    fake = ServerCommand("fake", (sys.executable, "-m", "bench.bench_router", "--fake-backend", str(port)), "/ready",
                         port, (("PYTHONPATH", str(Path(__file__).resolve().parents[1])),))
    request = RequestSpec("hi", 1, 4)
    out = {}
    with ServerProcess(fake, log_dir / "fake-backend.log") as backend, \
            ServerProcess(router_command([backend.base_url]), log_dir / "router-overhead.log") as router:
        wait_all_ready(router.base_url, 1)
        for label, url in (("direct", backend.base_url), ("via_router", router.base_url)):
            asyncio.run(run_load([request] * 20, LoadConfig(url, "fake", concurrency=1)))  # warm connections
            s = summarize(asyncio.run(run_load([request] * plan.overhead_requests, LoadConfig(url, "fake",
                                                                                            concurrency=1))))
            out[label] = {"e2e_ms": s["e2e_ms"], "ttft_ms": s["ttft_ms"], "num_errors": s["num_errors"]}
        out["added_latency_ms"] = {q: out["via_router"]["e2e_ms"][q] - out["direct"]["e2e_ms"][q]
                                   for q in ("p50", "p90", "p99")}
        cpu0 = cpu_seconds(router.process.pid)
        s = summarize(asyncio.run(run_load([request] * plan.overhead_throughput_requests,
                                           LoadConfig(router.base_url, "fake", concurrency=plan.overhead_concurrency))))
        cpu1 = cpu_seconds(router.process.pid)
    out["throughput"] = {"concurrency": plan.overhead_concurrency, "requests": plan.overhead_throughput_requests,
                         "num_errors": s["num_errors"], "requests_per_s_wall": s["requests_per_s"],
                         "router_cpu_ms_per_request": 1000 * (cpu1 - cpu0) / plan.overhead_throughput_requests,
                         "requests_per_router_cpu_second": plan.overhead_throughput_requests / max(1e-9, cpu1 - cpu0)}
    progress(f"overhead: +{out['added_latency_ms']['p50']:.2f} ms p50 per request, "
             f"{out['throughput']['requests_per_router_cpu_second']:.0f} requests per router CPU-second, "
             f"{s['requests_per_s']:.0f} req/s wall")
    return out


# -- 4. pick cost -------------------------------------------------------------------------------------------------


PICK_FLEET_SIZES = (10, 100, 1000)
PICK_BLOCKS = 7  # alternating blocks per implementation; the median block is reported
PICK_BLOCK_S = 0.05  # each block runs about this long


def pick_fleet(num_backends: int, seed: int):
    """A ready fleet of `num_backends` in a plausible mid-run state: speeds measured or not, some profiles, a
    few requests running on each, as the pool holds it after a scrape round."""
    from hpi_contracts.pool_profile import PoolProfile
    from hpi_router.affinity import HashRing
    from hpi_router.config import PolicySettings
    from hpi_router.pool import BackendPool

    rng = random.Random(seed)
    profiles = (None, PoolProfile(10.0, 1.0, 1000.0, 64), PoolProfile(80.0, 8.0, 100.0, 4, "assumed"))
    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(num_backends)]
    pool = BackendPool(PolicySettings())
    pool.apply(urls)
    for url in urls:
        backend = pool.get(url)
        backend.ready, backend.ejected_reason = True, None
        backend.decode_speed = rng.choice((None, rng.uniform(5, 100)))
        backend.profile = rng.choice(profiles)
        backend.num_running = float(rng.randint(0, 6))
    pool.rescale()
    return pool, HashRing(urls)


def pick_cost(progress) -> dict:
    from hpi_router.config import PolicySettings
    from hpi_router.policy import pick

    settings = PolicySettings()
    keys = [f"system prompt {i}" for i in range(40)]

    def scan(pool, ring, key):  # RouterState.choose + proxy at 3c2a292
        views = [b.view() for b in pool.ready()]
        backend = pool.get(pick(views, ring.order(key) if key else None, settings).url)
        backend.in_flight += 1
        backend.num_picks += 1
        backend.in_flight -= 1

    def indexed(pool, ring, key):  # RouterState.choose + proxy now
        backend = pool.get(pool.choose(ring.walk(key) if key else None).url)
        pool.started(backend)
        pool.finished(backend)

    def block_us(one, pool, ring, with_key: bool, num: int) -> float:
        start = time.perf_counter()
        for i in range(num):
            one(pool, ring, keys[i % len(keys)] if with_key else None)
        return (time.perf_counter() - start) / num * 1e6

    out = {}
    for n in PICK_FLEET_SIZES:
        row = {}
        for with_key in (False, True):
            label = "affinity_key" if with_key else "no_key"
            fleets = {"scan": pick_fleet(n, seed=n), "index": pick_fleet(n, seed=n)}
            impls = {"scan": scan, "index": indexed}
            reps = {name: max(20, int(PICK_BLOCK_S * 1e6 / block_us(impls[name], *fleets[name], with_key, 20)))
                    for name in impls}
            times: dict[str, list[float]] = {name: [] for name in impls}
            for _ in range(PICK_BLOCKS):
                for name, one in impls.items():
                    times[name].append(block_us(one, *fleets[name], with_key, reps[name]))
            scan_us, index_us = statistics.median(times["scan"]), statistics.median(times["index"])
            row[label] = {"scan_us": round(scan_us, 2), "index_us": round(index_us, 2),
                          "ratio_scan_over_index": round(scan_us / index_us, 1)}
        pool, _ = pick_fleet(n, seed=n)
        rounds = max(3, int(PICK_BLOCK_S / max(1e-6, n * 5e-6)))
        start = time.perf_counter()
        for _ in range(rounds):
            pool.rescale()
        row["rescale_per_round_us"] = round((time.perf_counter() - start) / rounds * 1e6, 1)
        out[str(n)] = row
        progress(f"pick at {n} backends: no key {row['no_key']}, affinity key {row['affinity_key']}, "
                 f"rescale {row['rescale_per_round_us']} us per round")
    return out


# -- all ----------------------------------------------------------------------------------------------------------


def run(plan: Plan, log_dir: Path, sections: tuple[str, ...], fleet_name: str = "batch1", progress=print) -> dict:
    from transformers import AutoTokenizer

    from bench.report import machine_description
    from hpi_runtime.model_source import resolve_model_dir

    fleet = FLEETS[fleet_name]
    results: dict = {}
    # The router-only sections carry their own machine record: a partial run must not restamp the one the
    # served sections (fleet, prefix) were measured on.
    if "pick" in sections:
        results["pick_cost"] = {"machine": machine_description(), **pick_cost(progress)}
    if "overhead" in sections:
        results["overhead"] = {"machine": machine_description(), **overhead(plan, log_dir, progress)}
    if {"fleet", "prefix"} & set(sections):
        results.update({"machine": machine_description(), "plan": asdict(plan),
                        f"fleet_{fleet_name}": [asdict(b) for b in fleet]})
        model_dir, _ = resolve_model_dir(None)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with ExitStack() as stack:
            urls = {}
            for b in fleet:
                command = hpi_command(b.num_threads, "--enforce-eager", "--kv-cache-memory", plan.kv_cache_memory,
                                      "--max-model-len", "1024", *b.args)
                command = replace(command, argv=(*b.prefix, *command.argv))
                urls[b.name] = stack.enter_context(ServerProcess(command, log_dir / f"hpi-{b.name}.log")).base_url
                progress(f"backend {b.name} up at {urls[b.name]}")
            if "fleet" in sections:
                results[f"mixed_fleet_{fleet_name}"] = mixed_fleet(plan, tokenizer, urls, log_dir, progress)
            if "prefix" in sections:
                results["prefix_cache"] = prefix_affinity(plan, tokenizer, urls, log_dir, progress)
    return results


SECTIONS = ("overhead", "fleet", "prefix", "pick")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes, results into bench/results/tmp/")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--slow-backend", default="batch1", choices=sorted(FLEETS),
                        help="how the third backend is made the weak one (see FLEETS)")
    parser.add_argument("--fake-backend", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fake_backend is not None:
        fake_backend_main(args.fake_backend)
        return
    out_dir = RESULTS / "tmp" if args.quick else RESULTS
    log_dir = RESULTS / "tmp" / "router-logs"
    results = run(QUICK if args.quick else Plan(), log_dir, tuple(args.sections), args.slow_backend)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "router.json"
    if path.exists() and set(args.sections) != set(SECTIONS):  # a partial run updates its parts
        results = {**json.loads(path.read_text()), **results}
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {out_dir / 'router.json'}")


if __name__ == "__main__":
    main()
