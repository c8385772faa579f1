"""A second start with a warm compile cache against the first (issue 38): `hpi serve --compile-cache-dir`.

Each round makes an empty compile cache directory, starts `hpi serve` on the embedded model with it (the first
pod on a new volume: the C++ CPU kernels and the model step compile), stops it, and starts it again on the same
directory (a second pod with the same model and profile). Every process gets its own empty XDG_CACHE_HOME and
TORCHINDUCTOR_CACHE_DIR, so nothing but the compile cache directory carries over. Timed from process start to
/ready 200 and to the first token of a greedy prompt; the phases are the server's own (hpi:startup_phase_seconds).

    .venv/bin/python -m bench.compile_cache                  # 2 rounds, ~10 minutes on a busy 2-core machine
    .venv/bin/python -m bench.compile_cache --rounds 1 --out bench/results/tmp/compile_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.cold_start import _complete, _wait_ready, cpu_isa, cpu_model
from bench.systems import hpi_command
from hpi_runtime.startup import PHASES

TARGET_SPEEDUP = 2.0  # issue 38: a second start with a warm compile cache at least 2x faster than the first
_PHASE_LINE = re.compile(r'^hpi:startup_phase_seconds\{[^}]*phase="(\w+)"[^}]*\} (\S+)$', re.MULTILINE)


def start_once(cache_dir: Path, log_path: Path, threads: int) -> dict:
    command = hpi_command(threads, "--compile-cache-dir", str(cache_dir))
    base_url = f"http://127.0.0.1:{command.port}"
    with tempfile.TemporaryDirectory(prefix="hpi-bench-home-") as home, open(log_path, "wb") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(command.env), "XDG_CACHE_HOME": f"{home}/xdg",
               "TORCHINDUCTOR_CACHE_DIR": f"{home}/inductor", "TRITON_CACHE_DIR": f"{home}/triton"}
        for name in ("TORCH_EXTENSIONS_DIR", "HPI_COMPILE_CACHE_DIR"):
            env.pop(name, None)
        start = time.perf_counter()
        process = subprocess.Popen(command.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_ready(process, base_url, timeout_s=1200)
            ready_s = time.perf_counter() - start
            _complete(base_url, 1)
            first_token_s = time.perf_counter() - start
            with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
                metrics = response.read().decode()
        finally:
            process.terminate()
            process.wait(120)
    phases = {name: float(value) for name, value in _PHASE_LINE.findall(metrics)}
    return {"to_ready_s": ready_s, "to_first_token_s": first_token_s, "phases_s": phases}


def run_round(index: int, threads: int) -> dict:
    logs = Path("bench/results/logs")
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hpi-compile-cache-") as cache_dir:
        first = start_once(Path(cache_dir), logs / f"compile_cache_{index}_first.log", threads)
        second = start_once(Path(cache_dir), logs / f"compile_cache_{index}_second.log", threads)
        cache_bytes = sum(p.stat().st_size for p in Path(cache_dir).rglob("*") if p.is_file())
    return {"first": first, "second": second, "cache_bytes": cache_bytes}


def summarize(rounds: list[dict]) -> dict:
    def median(start: str, key: str) -> float:
        return statistics.median(r[start][key] for r in rounds)

    def phase(start: str, name: str) -> float:
        return statistics.median(r[start]["phases_s"].get(name, 0.0) for r in rounds)

    names = [p for p in PHASES if any(p in r[s]["phases_s"] for r in rounds for s in ("first", "second"))]
    speedup = median("first", "to_first_token_s") / median("second", "to_first_token_s")
    return {
        "median_s": {s: {"to_ready": median(s, "to_ready_s"), "to_first_token": median(s, "to_first_token_s")}
                     for s in ("first", "second")},
        "median_phases_s": {s: {p: phase(s, p) for p in names} for s in ("first", "second")},
        "speedup": speedup, "target_speedup": TARGET_SPEEDUP, "meets_target": speedup >= TARGET_SPEEDUP,
    }  # fmt: skip


def render(result: dict) -> str:
    s, m = result["summary"], result["machine"]
    first, second = s["median_phases_s"]["first"], s["median_phases_s"]["second"]
    phase_rows = "\n".join(
        f"| {p.replace('_', ' ')} | {first[p]:.1f} | {second[p]:.1f} | {first[p] / max(second[p], 1e-9):.1f}x |"
        for p in first
    )
    round_rows = "\n".join(
        f"| {i + 1} | {r['first']['to_first_token_s']:.1f} | {r['second']['to_first_token_s']:.1f} | "
        f"{r['first']['to_first_token_s'] / r['second']['to_first_token_s']:.2f}x | "
        f"{r['first']['phases_s'].get('compile', 0):.1f} / {r['second']['phases_s'].get('compile', 0):.1f} | "
        f"{r['first']['phases_s'].get('prepare', 0):.1f} / {r['second']['phases_s'].get('prepare', 0):.1f} | "
        f"{r['cache_bytes'] / 2**20:.1f} |"
        for i, r in enumerate(result["rounds"])
    )
    med = s["median_s"]
    return f"""## A second start with a warm compile cache (`--compile-cache-dir`)

`bench/compile_cache.py`, {result['date']}. Machine: {m['cpu']}, {m['cores']} cores, {m['isa']}; torch {m['torch']}.
Shared and busy (other sessions compile and test on the same 2 cores): absolute seconds vary several-fold
between runs, so compare within a round. Each round: an empty compile cache directory, `hpi serve` (embedded
SmolLM2-135M-Instruct, defaults) started on it, stopped, started again; each process with its own empty
Inductor and XDG caches, so only the compile cache carries over. Medians of {len(result['rounds'])} rounds.

| | first start (empty cache) | second start (warm cache) | first / second |
|---|---:|---:|---:|
| process start -> /ready | {med['first']['to_ready']:.1f} s | {med['second']['to_ready']:.1f} s | \
{med['first']['to_ready'] / med['second']['to_ready']:.2f}x |
| process start -> first token | {med['first']['to_first_token']:.1f} s | {med['second']['to_first_token']:.1f} s | \
**{s['speedup']:.2f}x** |

Target (issue 38): a second start with a warm compile cache >= {s['target_speedup']:.0f}x faster than the first: \
{'met' if s['meets_target'] else 'NOT met'}.

By phase (seconds, medians; `prepare` includes building the C++ CPU kernels, which dtype auto needs to choose
bf16; `compile` is torch.compile of the model step and its warm-up per shape):

| phase | first | second | first / second |
|---|---:|---:|---:|
{phase_rows}

What the warm cache does not remove: Dynamo still traces the model in every process (its bytecode analysis is
not cached; the cache skips Inductor's lowering, code generation and the C++ compiler), and the C++ kernels
are still loaded (ninja finds them up to date).

| round | first start (s) | second start (s) | first / second | compile (s) first / second | prepare (s) first / \
second | cache (MiB) |
|---:|---:|---:|---:|---:|---:|---:|
{round_rows}

Raw data: [compile_cache.json](compile_cache.json).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/compile_cache.json"))
    args = parser.parse_args()
    import torch

    rounds = []
    for i in range(args.rounds):
        rounds.append(run_round(i, args.threads))
        r = rounds[-1]
        print(f"round {i + 1}: first {r['first']['to_first_token_s']:.1f} s {r['first']['phases_s']}, "
              f"second {r['second']['to_first_token_s']:.1f} s {r['second']['phases_s']}", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "rounds": rounds, "summary": summarize(rounds),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "isa": cpu_isa(), "torch": torch.__version__}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(result))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
