"""The CPU LoRA delta (torch.ops.hpi_kernels.lora_add_) against the base projection it rides on, in process: one
layer of the embedded SmolLM2-135M (q/k/v fused, o, gate/up fused, down; bf16, or --dtype float32 with the slots
in fp32 or in bf16 (--lora-dtype bfloat16); rank 16), for a prefill chunk
of one adapter's tokens, a prefill of six 64-token prompts of 4 adapters in turn, and a decode step of 16 rows
over 4 adapters. Printed: median ms of the delta (with the slots' AMX panels where the CPU runs the bf16 linears
on AMX), of the same delta in torch ops (x @ A, then @ B per part), and of the base projection, as `F.linear`
(oneDNN) and as the packed linear the served CPU model runs, with the delta's time as a fraction of each; the
delta's multiply-adds are 4.6% of the base's. The measurements alternate call by call, so the machine's drift
weighs on all alike. The bf16 tile (widened FMAs, vdpbf16ps or AMX) is the machine's own start-up choice unless
--tile names one; --no-amx-delta keeps the delta on its vector tiles (as before bench/results/lora.md run 17).

    .venv/bin/python -m bench.lora_delta [--tile dpbf16|widen] [--no-amx-delta] [--dtype float32 [--lora-dtype
        bfloat16]] [--out F]
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
from hpi_kernels.cpu.packed_linear import pack_linear_weight, packed_linear

RANK, SLOTS = 16, 4
# name: (in features, the parts' output columns); SmolLM2-135M: hidden 576, 3 KV heads of 64, MLP 1536
PROJECTIONS = {"qkv": (576, [0, 576, 768, 960]), "o": (576, [0, 576]), "gate_up": (576, [0, 1536, 3072]),
               "down": (1536, [0, 576])}  # fmt: skip
# name: (tokens, a run's tokens of one slot, the slots taking turns run by run)
CASES = {"prefill_374_one_adapter": (374, 374), "prefill_6x64_4_adapters": (384, 64),
         "decode_16_rows_4_adapters": (16, 1)}


def measure(tokens: int, run: int, rounds: int, amx_delta: bool, dtype: torch.dtype, slot_dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(tokens)
    timings = {"kernel": [], "torch_ops": [], "base": [], "base_packed": []}
    calls = []
    for in_features, cols in PROJECTIONS.values():
        parts, n = len(cols) - 1, cols[-1]
        x = torch.randn(tokens, in_features, generator=g).to(dtype)
        a = (torch.randn(SLOTS, parts * RANK, in_features, generator=g) * 0.05).to(slot_dtype)
        bt = (torch.randn(SLOTS, parts * RANK, n, generator=g) * 0.05).to(slot_dtype)
        weight = (torch.randn(n, in_features, generator=g) * 0.05).to(dtype)
        out = torch.randn(tokens, n, generator=g).to(dtype)
        packed = pack_linear_weight(weight)
        slots = torch.arange(tokens) // run % SLOTS
        # [S, 0] where the bf16 linears do not run AMX; None: the vector tiles whatever the CPU
        amx = torch.ops.hpi_kernels.lora_pack_amx(a, bt, cols) if amx_delta else None

        def torch_ops(x=x, a=a, bt=bt, out=out, cols=cols):  # one slot's tokens (the prefill case's form)
            a, bt = a.to(x.dtype), bt.to(x.dtype)  # (no copy where the slots are x's dtype)
            h = x @ a[0].t()
            for p, (c0, c1) in enumerate(itertools.pairwise(cols)):
                out[:, c0:c1].add_(h[:, p * RANK : (p + 1) * RANK] @ bt[0, p * RANK : (p + 1) * RANK, c0:c1])

        calls.append({"kernel": lambda out=out, x=x, a=a, bt=bt, s=slots, c=cols, p=amx:
                          torch.ops.hpi_kernels.lora_add_(out, x, a, bt, s, c, p),
                      "torch_ops": torch_ops, "base": lambda x=x, w=weight: F.linear(x, w),
                      "base_packed": lambda x=x, p=packed, n=n: packed_linear(x, p, n)})  # fmt: skip
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
    medians["kernel_over_base_packed"] = round(medians["kernel"] / medians["base_packed"], 4)
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tile", choices=["dpbf16", "widen"], help="force the bf16 tile (default: measured)")
    parser.add_argument("--no-amx-delta", action="store_true", help="the delta on its vector tiles even with AMX")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the model's dtype (float32: as served on CPUs without fast bf16)")
    parser.add_argument("--lora-dtype", choices=["auto", "bfloat16"], default="auto",
                        help="the slots' dtype (auto: the model's; bfloat16 under float32: hpi serve --lora-dtype)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    load_extension()
    if args.tile:
        bf16_tile(args.tile)
    result = {"machine": platform.processor() or platform.machine(), "bf16_tile": bf16_tile(),
              "amx_delta": not args.no_amx_delta,
              "threads": torch.get_num_threads(), "dtype": args.dtype, "lora_dtype": args.lora_dtype}  # fmt: skip
    for name, (tokens, run) in CASES.items():
        dtype = getattr(torch, args.dtype)
        slot_dtype = dtype if args.lora_dtype == "auto" else getattr(torch, args.lora_dtype)
        result[name] = measure(tokens, run, args.rounds, not args.no_amx_delta, dtype, slot_dtype)
        print(name, result[name])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
