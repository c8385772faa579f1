"""Where the CPU goes in a served run: CPU seconds of the API server (frontend), the engine core and the
load generator, per output token, measured from the processes' own counters (utime + stime).

CPU time, unlike wall time, is charged to the process that spent it, so the split holds on a shared,
noisy machine where tokens/s does not. Run `hpi serve` (any extra arguments after `--`), drive it with the
load generator at each concurrency, and print, per concurrency: output tok/s, the CPU milliseconds per
output token of each process, and the core's share of the machine (its CPU seconds over wall x cores).

    .venv/bin/python -m bench.bench_served_cpu --concurrency 1 32 -- --dtype float32
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import tempfile
import time
from pathlib import Path

import psutil
from transformers import AutoTokenizer

from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.systems import SERVED_MODEL_NAME, ServerProcess, hpi_command
from hpi_runtime.model_source import resolve_model_dir


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _isa() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return platform.machine()
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "no avx2"


def measure(server: ServerProcess, tokenizer, concurrency: int, num_requests: int, prompt_len: int,
            output_len: int, seed: int) -> dict:
    frontend = psutil.Process(server.process.pid)
    core = max(frontend.children(), key=_cpu_s)  # the engine core: the child that loaded and compiled the model
    spec = WorkloadSpec(num_requests, LengthDist(prompt_len), LengthDist(output_len), seed)
    requests = build_requests(tokenizer, spec)
    config = LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=concurrency, seed=seed)
    before = (_cpu_s(frontend), _cpu_s(core), _self_cpu_s(), time.perf_counter())
    summary = summarize(asyncio.run(run_load(requests, config)))
    after = (_cpu_s(frontend), _cpu_s(core), _self_cpu_s(), time.perf_counter())
    wall = after[3] - before[3]
    tokens = summary["output_tokens_per_s"] * summary["duration_s"]
    per_token = [1000 * (a - b) / tokens for a, b in zip(after[:3], before[:3], strict=True)]
    return {
        "concurrency": concurrency,
        "errors": summary["errors"],
        "tok_s": tokens / wall,
        "frontend_ms_per_tok": per_token[0],
        "core_ms_per_tok": per_token[1],
        "loadgen_ms_per_tok": per_token[2],
        "core_share": (after[1] - before[1]) / (wall * psutil.cpu_count()),
        "frontend_share": (after[0] - before[0]) / (wall * psutil.cpu_count()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("hpi_args", nargs="*", help="extra `hpi serve` arguments (after --)")
    args = parser.parse_args()
    model_dir, _ = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} cores, ISA: {_isa()}; "
          f"hpi serve {' '.join(args.hpi_args)}; OMP_NUM_THREADS={args.threads}")
    print(f"{'N':>4} {'tok/s':>8} {'frontend ms/tok':>16} {'core ms/tok':>12} {'loadgen ms/tok':>15} "
          f"{'core share':>11} {'frontend share':>15}")
    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess(hpi_command(args.threads, *args.hpi_args), Path(tmp) / "hpi.log") as server:
        warm = WorkloadSpec(2, LengthDist(16), LengthDist(8), seed=999)
        asyncio.run(run_load(build_requests(tokenizer, warm), LoadConfig(server.base_url, SERVED_MODEL_NAME, 2)))
        for i, n in enumerate(args.concurrency):
            row = measure(server, tokenizer, n, n * args.requests_per_client, args.prompt_len, args.output_len,
                          seed=100 + i)
            print(f"{n:>4} {row['tok_s']:>8.1f} {row['frontend_ms_per_tok']:>16.2f} {row['core_ms_per_tok']:>12.2f} "
                  f"{row['loadgen_ms_per_tok']:>15.2f} {row['core_share']:>11.0%} {row['frontend_share']:>15.0%}"
                  + (f"  errors: {row['errors']}" if row["errors"] else ""))


if __name__ == "__main__":
    main()
