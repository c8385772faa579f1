"""Microbenchmark: the linears of the embedded model's decoder layers (SmolLM2-135M: q/k/v 960 x 576, o 576 x
576, gate/up 3072 x 576, down 576 x 1536; --layers layers of distinct weights, which together do not fit the
caches) at decode-sized row counts, per weight format, timed in alternation in one process (median of
--rounds): packed fp32 and bf16 (hpi_kernels.packed_linear), torch's own int8/int4 CPU ops (what
QuantizedLinear ran before hpi_kernels' quantized panels), and hpi_kernels' int8_linear / int8_a8_linear (W8A8) /
int4_linear / int4_a8_linear (W4A8; both a8 ops quantize x to int8 per group). Prints
microseconds per pass over the layers and ratios against the faster unquantized format.

    .venv/bin/python bench/bench_quant_linear.py --rows 1 8 32 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from hpi_kernels.cpu import pack_linear_weight, packed_linear
from hpi_kernels.cpu.quant_linear import (
    int4_a8_linear,
    int4_linear,
    int8_a8_linear,
    int8_linear,
    pack_int4_weight,
    pack_int8_weight,
)
from hpi_kernels.quant import quantize_int4, quantize_int8, to_torch_scales_and_zeros, unpack_int4

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
GROUP_SIZE = 32


def _layer_calls(dtype: torch.dtype, rows: int, layers: int) -> dict[str, Callable[[], None]]:
    """format -> one call of every linear of `layers` layers (distinct weights: together they do not fit the
    caches, as in the model), inputs in `dtype` (the activation dtype)."""
    calls: dict[str, list[Callable[[], object]]] = {}
    name = str(dtype).removeprefix("torch.")
    for n, k in [shape for _ in range(layers) for shape in SHAPES.values()]:
        w = torch.randn(n, k) * 0.05
        x = torch.randn(rows, k).to(dtype)
        pf = pack_linear_weight(w.to(dtype))
        calls.setdefault(f"packed {name}", []).append(lambda x=x, p=pf, n=n: packed_linear(x, p, n))
        q8, s8 = quantize_int8(w, torch.bfloat16)
        p8, sc8 = pack_int8_weight(q8, s8)
        calls.setdefault(f"int8 hpi {name}", []).append(lambda x=x, p=p8, s=sc8, n=n: int8_linear(x, p, s, n))
        calls.setdefault(f"int8 a8 hpi {name}", []).append(lambda x=x, p=p8, s=sc8, n=n: int8_a8_linear(x, p, s, n))
        q4, s4, z4 = quantize_int4(w, GROUP_SIZE, torch.bfloat16)
        p4, sz4 = pack_int4_weight(q4, s4, z4, GROUP_SIZE)
        calls.setdefault(f"int4 hpi {name}", []).append(
            lambda x=x, p=p4, sz=sz4, n=n: int4_linear(x, p, sz, GROUP_SIZE, n)
        )
        calls.setdefault(f"int4 a8 hpi {name}", []).append(
            lambda x=x, p=p4, sz=sz4, n=n: int4_a8_linear(x, p, sz, GROUP_SIZE, n)
        )
        if dtype == torch.bfloat16:  # torch's CPU ops compute in bf16 (fp32 x is rounded to it)
            tq = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(q4).to(torch.int32), 1)
            tsz = to_torch_scales_and_zeros(s4, z4)
            calls.setdefault("int8 torch", []).append(
                lambda x=x, q=q8, s=s8: torch.ops.aten._weight_int8pack_mm(x, q, s)
            )
            calls.setdefault("int4 torch", []).append(
                lambda x=x, q=tq, sz=tsz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, GROUP_SIZE, sz)
            )

    def run(fns: list[Callable[[], object]]) -> Callable[[], None]:
        def layer() -> None:
            for fn in fns:
                fn()

        return layer

    return {name: run(fns) for name, fns in calls.items()}


def _time_us(fn: Callable[[], None], min_s: float = 0.05) -> float:
    fn()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s:
        fn()
        count += 1
    return elapsed / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (30: the embedded model's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability "
          f"{torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    results = {}
    for rows in args.rows:
        calls = {**_layer_calls(torch.float32, rows, args.layers), **_layer_calls(torch.bfloat16, rows, args.layers)}
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                samples[name].append(_time_us(fn))
        us = {name: statistics.median(s) for name, s in samples.items()}
        results[rows] = us
        base = min(us["packed float32"], us["packed bfloat16"])
        print(
            f"rows {rows}: " + ", ".join(f"{name} {t:.0f} us ({base / t:.2f}x)" for name, t in us.items()), flush=True
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
