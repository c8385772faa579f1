"""Microbenchmark: the embedded model's LM head (49152 x 576, bf16 weights packed for hpi_kernels) at decode-sized
row counts, its logits two ways, timed in alternation in one process (median of --rounds): rounded to bf16 by
the kernel and widened to fp32 after (what LMHead returned before), and the kernel's fp32 sums returned as they
are (hpi_kernels.packed_logits: greedy choices are no longer decided by bf16's steps of 0.125 at logits of
16-32). Prints milliseconds per call and the ratio fp32 / rounded; writes bench/results/lm_head_fp32.json.

    .venv/bin/python bench/bench_lm_head.py --rows 1 8 32
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.report import machine_description, ms_per_call
from hpi_kernels.cpu.packed_linear import pack_linear_weight, packed_linear, packed_logits

VOCAB, HIDDEN = 49152, 576


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lm_head_fp32.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    packed = pack_linear_weight((torch.randn(VOCAB, HIDDEN) * 0.05).to(torch.bfloat16))
    rows_out = []
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
        ways = {"rounded": lambda x=x: packed_linear(x, packed, VOCAB, None).float(),
                "fp32": lambda x=x: packed_logits(x, packed, VOCAB)}  # fmt: skip
        for call in ways.values():
            call()  # warm up
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, call in ways.items():
                times[name].append(ms_per_call(call, args.calls))
        medians = {name: statistics.median(t) for name, t in times.items()}
        ratio = medians["fp32"] / medians["rounded"]
        rows_out.append({"rows": rows, "rounded_ms": medians["rounded"], "fp32_ms": medians["fp32"], "ratio": ratio})
        print(f"rows {rows:3d}: rounded to bf16 {medians['rounded']:.2f} ms, fp32 {medians['fp32']:.2f} ms, "
              f"fp32 / rounded {ratio:.2f}")  # fmt: skip
    args.out.write_text(json.dumps({"machine": machine_description(), "results": rows_out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
