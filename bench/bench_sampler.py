"""Microbenchmark: drawing one token per row from temperature-scaled probabilities over SmolLM2's 49,152-token
vocabulary, the two ways the sampler has done it, timed in alternation in one process (median of --rounds): the
exponential race (argmax(p / E), E ~ Exp(1) drawn per vocabulary entry: the sampler before 2026-12-03) and
inverse transform sampling (one uniform per row in the row's fp64 cumulative sums: worker/sampler.py's `_draw`).
Prints milliseconds per call and the ratio; writes bench/results/sampler.json.

    .venv/bin/python -m bench.bench_sampler --rows 1 8 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.report import machine_description
from hpi_runtime.worker.sampler import _draw

VOCAB = 49152


def _exponential_race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    noise = torch.empty(probs.shape).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _ms_per_call(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sampler.json")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    results = []
    for rows in args.rows:
        probs = (torch.randn(rows, VOCAB, generator=generator) * 3).softmax(dim=-1)
        ways = {"exponential race": lambda p=probs: _exponential_race(p, generator),
                "inverse transform": lambda p=probs: _draw(p, (None,) * len(p), generator)}  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, call in ways.items():
                times[name].append(_ms_per_call(call, args.calls))
        medians = {name: statistics.median(t) for name, t in times.items()}
        speedup = medians["exponential race"] / medians["inverse transform"]
        results.append({"rows": rows, **{f"{k.replace(' ', '_')}_ms": v for k, v in medians.items()},
                        "speedup": speedup})  # fmt: skip
        print(f"rows {rows:3d}: exponential race {medians['exponential race']:.3f} ms, inverse transform "
              f"{medians['inverse transform']:.3f} ms: {speedup:.1f}x")  # fmt: skip
    args.out.write_text(json.dumps({"machine": machine_description(), "vocab": VOCAB, "results": results},
                                   indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
