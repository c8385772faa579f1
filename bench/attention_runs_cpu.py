"""Decode attention with a request's kv heads taken by one thread (paged_attention.cpp's plan_runs) against every
(request, kv head) item claimed alone (`HPI_CPU_ATTENTION_RUNS=0`, as before), in process: one decode step's
attention over the embedded model's 30 layers (9 q heads, 3 kv heads, head_dim 64, block 16), `requests` rows of
`context` keys each, each layer's cache of its own (30 of them: past L3, in memory, as when serving), blocks in
order or shuffled. The setting is read once per process, so the two run in alternating child processes, round by
round. Printed: median ms of a step for each and their ratio, per case; the CPU's capability with them.

    .venv/bin/python -m bench.attention_runs_cpu [--cases 1x1024 2x1024 8x512 32x192] [--rounds 4] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def measure(requests: int, context: int, shuffled: bool, steps: int) -> float:
    """Median ms of one decode step's attention over LAYERS caches (this process's setting)."""
    import time

    import torch

    from hpi_kernels.cpu import load_extension

    load_extension()
    g = torch.Generator().manual_seed(0)
    per_request = -(-context // BLOCK)
    total = requests * per_request
    layers = []
    for _ in range(LAYERS):
        k, v = (torch.randn(total, BLOCK, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
        order = torch.randperm(total, generator=g) if shuffled else torch.arange(total)
        layers.append((k, v, order.int().view(requests, per_request)))
    q = torch.randn(requests, HEADS, HEAD_DIM, generator=g)
    out = torch.empty_like(q)
    query_start = torch.arange(requests + 1, dtype=torch.int32)
    context_lens = torch.full((requests,), context, dtype=torch.int32)
    op = torch.ops.hpi_kernels.paged_attention_cpu
    times = []
    for step in range(steps + 3):
        start = time.perf_counter()
        for k, v, tables in layers:
            op(out, q, k, v, tables, query_start, context_lens, HEAD_DIM**-0.5, 0, 0.0)
        if step >= 3:  # after the warm-up
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def child(requests: int, context: int, shuffled: bool, grouped: bool, steps: int) -> float:
    env = {**os.environ, "HPI_CPU_ATTENTION_RUNS": "1" if grouped else "0"}
    command = [sys.executable, "-m", "bench.attention_runs_cpu", "--child", str(requests), str(context),
               str(int(shuffled)), str(steps)]  # fmt: skip
    return float(subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout.split()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["1x1024", "2x1024", "8x512", "32x192"],
                        help="REQUESTSxCONTEXT")  # fmt: skip
    parser.add_argument("--shuffled", action="store_true", help="blocks in random order (an aged free list)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out")
    parser.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        requests, context, shuffled, steps = args.child
        print(measure(requests, context, bool(shuffled), steps))
        return
    from hpi_kernels.cpu import cpu_capability

    result: dict = {"machine": platform.processor() or platform.machine(), "capability": cpu_capability(),
                    "shuffled": args.shuffled, "cases": {}}  # fmt: skip
    for case in args.cases:
        requests, context = (int(part) for part in case.split("x"))
        runs: dict[str, list[float]] = {"runs": [], "items": []}
        for _ in range(args.rounds):
            for key in runs:
                runs[key].append(child(requests, context, args.shuffled, key == "runs", args.steps))
        medians = {key: round(statistics.median(values), 2) for key, values in runs.items()}
        result["cases"][case] = {**medians, "runs_over_items": round(medians["runs"] / medians["items"], 3),
                                 "all": runs}  # fmt: skip
        print(case, medians, "runs / items", result["cases"][case]["runs_over_items"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
