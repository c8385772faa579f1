"""Microbenchmark: the sampler's two costly parts over SmolLM2's 49,152-token vocabulary, each the way it was
before 2026-12-03 and the way it is now, timed in alternation in one process (median of --rounds):
- drawing one token per row from temperature-scaled probabilities: the exponential race (argmax(p / E), E ~
  Exp(1) drawn per vocabulary entry) against inverse transform sampling (one uniform per row in the row's fp64
  cumulative sums: worker/sampler.py's `_draw`);
- top-p 0.95: a full sort of every row (filter_by_full_sort) against the search among each row's best tokens
  first (worker/sampler.py's `apply_top_k_top_p_min_p`), on peaked rows (logits ~ N(0, 12^2): a nucleus of a
  handful of tokens), flat ones (N(0, 4^2): hundreds) and a mix of 80% peaked;
- the greedy pick (temperature 0: every benchmark of record): `argmax` against `max(dim=-1).indices` (the
  sampler's since 2026-12-05), which return the same index.
Prints milliseconds per call and the ratios; writes bench/results/sampler.json.

    .venv/bin/python -m bench.bench_sampler --rows 1 8 32
    .venv/bin/python -m bench.bench_sampler --parts greedy --rows 1 8 32 64 --out bench/results/sampler_greedy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.report import machine_description, ms_per_call
from hpi_runtime.worker.sampler import SamplingBatch, _draw, apply_top_k_top_p_min_p

VOCAB = 49152


def _exponential_race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    noise = torch.empty(probs.shape).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def filter_by_full_sort(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k, top-p and min-p as a full sort of each row computes them (the sampler's way before 2026-12-03)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)
    top_k = torch.where(batch.top_k > 0, batch.top_k, logits.shape[1])
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    outside_top_p = (probs.cumsum(dim=-1) - probs) >= batch.top_p[:, None]
    outside_top_p[:, 0] = False
    below_min_p = probs < batch.min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(outside_top_p | below_min_p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_p_batch(rows: int) -> SamplingBatch:
    return SamplingBatch(temperature=torch.ones(rows), top_k=torch.zeros(rows, dtype=torch.int64),
                         top_p=torch.full((rows,), 0.95), min_p=torch.zeros(rows), seeds=(None,) * rows,
                         num_logprobs=(None,) * rows)  # fmt: skip


def _timed(ways: dict, rounds: int, calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, call in ways.items():
            times[name].append(ms_per_call(call, calls))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sampler.json")
    parser.add_argument("--parts", nargs="+", default=["draw", "top_p", "greedy"], choices=["draw", "top_p", "greedy"])
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    results = []
    for rows in args.rows if "draw" in args.parts else []:
        probs = (torch.randn(rows, VOCAB, generator=generator) * 3).softmax(dim=-1)
        ways = {"exponential race": lambda p=probs: _exponential_race(p, generator),
                "inverse transform": lambda p=probs: _draw(p, (None,) * len(p), generator)}  # fmt: skip
        medians = _timed(ways, args.rounds, args.calls)
        speedup = medians["exponential race"] / medians["inverse transform"]
        results.append({"part": "draw", "rows": rows, **{f"{k.replace(' ', '_')}_ms": v for k, v in medians.items()},
                        "speedup": speedup})  # fmt: skip
        print(f"draw, rows {rows:3d}: exponential race {medians['exponential race']:.3f} ms, inverse transform "
              f"{medians['inverse transform']:.3f} ms: {speedup:.1f}x", flush=True)  # fmt: skip
    for rows in args.rows if "top_p" in args.parts else []:
        peaked = torch.rand(rows, generator=generator) < 0.8
        for kind, scale in (("peaked", 12.0), ("flat", 4.0), ("80% peaked", torch.where(peaked, 12.0, 4.0)[:, None])):
            logits = torch.randn(rows, VOCAB, generator=generator) * scale
            batch = _top_p_batch(rows)
            ways = {"full sort": lambda x=logits, b=batch: filter_by_full_sort(x, b),
                    "best tokens first": lambda x=logits, b=batch: apply_top_k_top_p_min_p(x, b)}  # fmt: skip
            medians = _timed(ways, args.rounds, max(1, args.calls // 2))
            speedup = medians["full sort"] / medians["best tokens first"]
            times = {f"{k.replace(' ', '_')}_ms": v for k, v in medians.items()}
            results.append({"part": "top_p", "rows": rows, "logits": kind, **times, "speedup": speedup})
            print(f"top-p 0.95, {kind} rows, {rows:3d}: full sort {medians['full sort']:.2f} ms, best tokens first "
                  f"{medians['best tokens first']:.2f} ms: {speedup:.2f}x", flush=True)  # fmt: skip
    for rows in args.rows if "greedy" in args.parts else []:
        logits = torch.randn(rows, VOCAB, generator=generator) * 4
        ways = {"argmax": lambda x=logits: x.argmax(dim=-1), "max indices": lambda x=logits: x.max(dim=-1).indices}
        if not torch.equal(ways["argmax"](), ways["max indices"]()):
            raise SystemExit("argmax and max(dim=-1).indices disagree")
        medians = _timed(ways, args.rounds, args.calls)
        speedup = medians["argmax"] / medians["max indices"]
        times = {f"{k.replace(' ', '_')}_ms": v for k, v in medians.items()}
        results.append({"part": "greedy", "rows": rows, **times, "speedup": speedup})
        print(f"greedy, rows {rows:3d}: argmax {medians['argmax']:.3f} ms, max indices {medians['max indices']:.3f} "
              f"ms: {speedup:.2f}x", flush=True)  # fmt: skip
    args.out.write_text(json.dumps({"machine": machine_description(), "vocab": VOCAB, "results": results},
                                   indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
