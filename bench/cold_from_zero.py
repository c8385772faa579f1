"""The first request at zero replicas to its first token, by phase, and no request lost (issue 38).

The local harness equivalent of the operator under the emulator with a fake kubelet, built from the real parts:
a real `hpi router` whose only backend's address has nothing behind it (the pool at zero: the router holds the
requests in its queue), the operator's own scrape of the router's queue (`scrape_router_queue`) and its own pure
decision (`decide`), polled every POLL_S as the builtin scaler polls, and, when the decision leaves zero, a
"kubelet" that starts a real `hpi serve` (the embedded model) at the backend's address. The router probes the
backend, finds it ready and sends the held requests.

Phases of the first request: `detect` (sent -> the poll that decides 0 -> 1), `start` (that decision -> the
runtime's /ready, split by the runtime's own start-up phases), `route` (ready -> its first token through the
router). Then all N requests: each completes with 200 or gets the router's documented 503 (queue full or waited
out, with Retry-After), never a connection error.

    .venv/bin/python -m bench.cold_from_zero                   # 200 requests, ~2-5 minutes on 2 cores
    .venv/bin/python -m bench.cold_from_zero --compile-cache-dir /tmp/cc   # a pod whose compile cache is warm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp

from bench.cold_start import _wait_ready, cpu_isa, cpu_model
from bench.systems import SERVED_MODEL_NAME, free_port
from hpi_operator.autoscaling.decision import History, decide
from hpi_operator.autoscaling.router_queue import scrape_router_queue
from hpi_operator.autoscaling.scrape import PodTarget, observation
from hpi_operator.spec import AutoscalingSpec

POLL_S = 1.0  # the builtin scaler's pollIntervalSeconds here (the CRD's default is 15 s: up to 14 s more detect)
SETTINGS = AutoscalingSpec(enabled=True, min_replicas=0, max_replicas=1, scale_to_zero=True, poll_interval_s=1)
_PHASE_LINE = re.compile(r'^hpi:startup_phase_seconds\{[^}]*phase="(\w+)"[^}]*\} (\S+)$', re.MULTILINE)


async def one_request(session: aiohttp.ClientSession, router_url: str, index: int, t0: float) -> dict:
    """A streamed completion: its status, and when its first token arrived (seconds after t0)."""
    body = {"model": SERVED_MODEL_NAME, "prompt": f"Request {index}: the capital of France is", "max_tokens": 8,
            "temperature": 0.0, "stream": True}  # fmt: skip
    try:
        async with session.post(f"{router_url}/v1/completions", json=body) as response:
            if response.status != 200:
                return {"status": response.status, "retry_after": response.headers.get("Retry-After"),
                        "body": (await response.text())[:200]}  # fmt: skip
            first_token_s = None
            async for line in response.content:
                if first_token_s is None and line.startswith(b"data: {"):
                    first_token_s = time.perf_counter() - t0
            return {"status": 200, "first_token_s": first_token_s, "done_s": time.perf_counter() - t0}
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return {"status": "connection error", "detail": repr(e)[:200]}


async def autoscaler(router_url: str, t0: float) -> float:
    """The builtin scaler's poll against the router's queue until it leaves zero: when it did (after t0)."""
    history, target = History(), PodTarget("router-0", f"{router_url}/metrics")
    while True:
        queue = await scrape_router_queue([target])
        now = time.time()
        decision = decide(SETTINGS, 0, observation((), queue.num_queued), history, now)
        history = decision.history
        if decision.desired_replicas > 0:
            return time.perf_counter() - t0
        await asyncio.sleep(POLL_S)


async def run(num_requests: int, compile_cache_dir: str | None, logs: Path) -> dict:
    router_port, runtime_port = free_port(), free_port()
    router_url, runtime_url = f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{runtime_port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs.mkdir(parents=True, exist_ok=True)
    router_log = open(logs / "cold_from_zero_router.log", "wb")
    router = subprocess.Popen([sys.executable, "-m", "hpi_router.cli", "--backend", runtime_url, "--port",
                               str(router_port), "--probe-interval", "0.2", "--log-level", "warning"],
                              stdout=router_log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    cache = "none" if not compile_cache_dir else "warm" if any(Path(compile_cache_dir).glob("*/*")) else "empty"
    runtime = None
    try:
        await asyncio.to_thread(_wait_ready, router, router_url, 1200, "/health")
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            t0 = time.perf_counter()
            requests = [asyncio.create_task(one_request(session, router_url, i, t0)) for i in range(num_requests)]
            decided_s = await autoscaler(router_url, t0)
            extra = ["--compile-cache-dir", compile_cache_dir] if compile_cache_dir else []
            runtime = subprocess.Popen([sys.executable, "-m", "hpi_runtime.cli", "serve", "--port", str(runtime_port),
                                        "--served-model-name", SERVED_MODEL_NAME, "--log-level", "warning", *extra],
                                       stdout=open(logs / "cold_from_zero_runtime.log", "wb"), stderr=subprocess.STDOUT,
                                       env=env)  # fmt: skip
            await asyncio.to_thread(_wait_ready, runtime, runtime_url, 1200)
            ready_s = time.perf_counter() - t0
            results = await asyncio.gather(*requests)
        with urllib.request.urlopen(f"{runtime_url}/metrics", timeout=30) as response:
            phases = {name: float(v) for name, v in _PHASE_LINE.findall(response.read().decode())}
    finally:
        for process in (runtime, router):
            if process is not None:
                process.terminate()
                process.wait(120)
    first = min((r["first_token_s"] for r in results if r.get("first_token_s") is not None), default=None)
    return {"num_requests": num_requests, "compile_cache": cache,
            "poll_s": POLL_S, "decided_s": decided_s, "ready_s": ready_s, "first_token_s": first,
            "runtime_phases_s": phases, "outcomes": dict(Counter(str(r["status"]) for r in results)),
            "results": results}  # fmt: skip


def _seconds(at_s: float | None, since_s: float = 0.0) -> str:
    return "none served" if at_s is None else f"{at_s - since_s:.1f}"


def render(result: dict, json_name: str = "cold_from_zero.json") -> str:
    r, m = result["run"], result["machine"]
    phases = "\n".join(f"| &nbsp;&nbsp;runtime: {p.replace('_', ' ')} | {s:.1f} |"
                       for p, s in r["runtime_phases_s"].items())  # fmt: skip
    start_s = r["ready_s"] - r["decided_s"]
    outcomes = ", ".join(f"{n} answered {status}" for status, n in sorted(r["outcomes"].items()))
    lost = sum(n for status, n in r["outcomes"].items() if status not in ("200", "503"))
    served = sorted(x["first_token_s"] for x in r["results"] if x.get("first_token_s") is not None)
    done_s = max((x["done_s"] for x in r["results"] if "done_s" in x), default=float("nan"))
    spread = (f"first tokens of all {len(served)} served: median {served[len(served) // 2]:.1f} s, last "
              f"{served[-1]:.1f} s after sending; all done {done_s:.1f} s after sending") if served else ""
    return f"""# Cold start from zero: the first request at zero replicas to its first token (CPU)

`bench/cold_from_zero.py`, {result['date']}. Machine: {m['cpu']}, {m['cores']} cores, {m['isa']}; torch
{m['torch']}; shared and busy. A real `hpi router` with its one backend down (the pool at zero), the operator's
scrape of the router's queue and its `decide` polled every {r['poll_s']:.0f} s, a "kubelet" that starts a real
`hpi serve` (embedded SmolLM2-135M-Instruct, defaults; compile cache: {r['compile_cache']}) when the decision
leaves zero. {r['num_requests']} streamed completions (8 tokens) sent at once at zero replicas.

| phase of the first request | seconds |
|---|---:|
| detect: sent -> the autoscaler's decision 0 -> 1 | {r['decided_s']:.1f} |
| start: decision -> runtime /ready | {start_s:.1f} |
{phases}
| route: /ready -> the router's probe -> first token (the first prefill among all the held requests) | \
{_seconds(r['first_token_s'], r['ready_s'])} |
| **total: first request sent -> its first token** | **{_seconds(r['first_token_s'])}** |

The runtime's phases are its own (hpi:startup_phase_seconds; they add up to a little less than `start`, which
also holds the process's launch before Python runs). In a cluster add the pod's scheduling and image pull, and
up to one poll interval (15 s by default) in `detect`.

No request lost: of {r['num_requests']}, {outcomes}; connection errors or other statuses: {lost} (issue 38: every
request completes or gets the documented 503 with Retry-After when the queue bound, 1024 by default, is exceeded
or a request waits longer than 300 s{f"; {spread}" if spread else ""}). The 503 paths are also tested in
tests/router/test_router_queue.py.

Raw data: [{json_name}]({json_name}).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--compile-cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cold_from_zero.json"))
    args = parser.parse_args()
    import torch

    result = {"date": time.strftime("%Y-%m-%d"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "isa": cpu_isa(), "torch": torch.__version__},
              "run": asyncio.run(run(args.requests, args.compile_cache_dir, Path("bench/results/logs")))}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(result, args.out.name))
    run_summary = {k: v for k, v in result["run"].items() if k != "results"}
    print(json.dumps(run_summary, indent=1))


if __name__ == "__main__":
    main()
