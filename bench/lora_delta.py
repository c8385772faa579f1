"""The CPU LoRA delta (torch.ops.hpi_kernels.lora_add_) against the base projection it rides on, in process: one
layer of the embedded SmolLM2-135M (q/k/v fused, o, gate/up fused, down; bf16, rank 16), for a prefill chunk
of one adapter's tokens and a decode step of 16 rows over 4 adapters. Printed: median ms of the delta, of the
same delta in torch ops (x @ A, then @ B per part), and of the base projection (`F.linear`, what the layer costs
without an adapter), with the delta's time as a fraction of the base's; the delta's multiply-adds are 4.6% of
the base's. The measurements alternate call by call, so the machine's drift weighs on all three alike. The
bf16 tile (widened FMAs or vdpbf16ps) is the machine's own start-up choice unless --tile names one.

    .venv/bin/python -m bench.lora_delta [--tile dpbf16|widen] [--out F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from hpi_kernels.cpu import bf16_tile, load_extension

RANK, SLOTS = 16, 4
# name: (in features, the parts' output columns); SmolLM2-135M: hidden 576, 3 KV heads of 64, MLP 1536
PROJECTIONS = {"qkv": (576, [0, 576, 768, 960]), "o": (576, [0, 576]), "gate_up": (576, [0, 1536, 3072]),
               "down": (1536, [0, 576])}  # fmt: skip
CASES = {"prefill_374_one_adapter": (374, False), "decode_16_rows_4_adapters": (16, True)}


def measure(tokens: int, spread: bool, rounds: int) -> dict:
    g = torch.Generator().manual_seed(tokens)
    timings = {"kernel": [], "torch_ops": [], "base": []}
    calls = []
    for in_features, cols in PROJECTIONS.values():
        parts, n = len(cols) - 1, cols[-1]
        x = torch.randn(tokens, in_features, generator=g).bfloat16()
        a = (torch.randn(SLOTS, parts * RANK, in_features, generator=g) * 0.05).bfloat16()
        bt = (torch.randn(SLOTS, parts * RANK, n, generator=g) * 0.05).bfloat16()
        weight = (torch.randn(n, in_features, generator=g) * 0.05).bfloat16()
        out = torch.randn(tokens, n, generator=g).bfloat16()
        slots = torch.arange(tokens) % SLOTS if spread else torch.zeros(tokens, dtype=torch.int64)

        def torch_ops(x=x, a=a, bt=bt, out=out, cols=cols):  # one slot's tokens (the prefill case's form)
            h = x @ a[0].t()
            for p, (c0, c1) in enumerate(itertools.pairwise(cols)):
                out[:, c0:c1].add_(h[:, p * RANK : (p + 1) * RANK] @ bt[0, p * RANK : (p + 1) * RANK, c0:c1])

        calls.append({"kernel": lambda out=out, x=x, a=a, bt=bt, s=slots, c=cols: torch.ops.hpi_kernels.lora_add_(
                          out, x, a, bt, s, c),
                      "torch_ops": torch_ops, "base": lambda x=x, w=weight: F.linear(x, w)})  # fmt: skip
    for _ in range(3):  # warm up
        for layer in calls:
            for call in layer.values():
                call()
    for _ in range(rounds):
        for key in timings:
            start = time.perf_counter()
            for layer in calls:
                layer[key]()
            timings[key].append((time.perf_counter() - start) * 1e3)
    medians = {key: round(statistics.median(values), 4) for key, values in timings.items()}
    medians["kernel_over_base"] = round(medians["kernel"] / medians["base"], 4)
    medians["torch_ops_over_base"] = round(medians["torch_ops"] / medians["base"], 4)
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tile", choices=["dpbf16", "widen"], help="force the bf16 tile (default: measured)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    load_extension()
    if args.tile:
        bf16_tile(args.tile)
    result = {"machine": platform.processor() or platform.machine(), "bf16_tile": bf16_tile(),
              "threads": torch.get_num_threads()}  # fmt: skip
    for name, (tokens, spread) in CASES.items():
        result[name] = measure(tokens, spread, args.rounds)
        print(name, result[name])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
