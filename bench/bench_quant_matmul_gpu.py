"""The GPU weight-only matmuls (hpi_kernels.quant_matmul) against bf16 torch.matmul (cuBLAS), on Llama-3.1-8B's
linears, in GPU time.

    python -m bench.bench_quant_matmul_gpu --out results.json [--budget 120] [--baseline-module path.py]

For each projection shape and row count: bf16 torch.matmul; the int8 and int4 matmuls as dispatched (the kernels'
default tiles below DEQUANT_MIN_ROWS rows, the dequantized copy + torch.matmul from there); the kernels with K
unsplit; the dequantized path at every row count; and, with --baseline-module (a copy of an earlier
quant_matmul.py), that version's kernels, side by side.

Timing: each variant's calls are captured into a CUDA graph (ten calls, rotating through enough weight copies to
exceed the 60 MB L2, as a model's layers do) and the graph is replayed: the time is the GPU's alone, as in a
decode step under CUDA graphs. Timing launches one by one instead measures the Python launcher (a first try here
read ~70 us for every small int8 matmul, whatever its tiles). Milliseconds per call, best of 3 replays.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from bench.gpu import part
from hpi_kernels import quant_matmul as qm
from hpi_kernels.quant import quantize_int4, quantize_int8

SHAPES = {  # name -> (N, K) of x @ W.T
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
}  # fmt: skip
ROWS = (1, 16, 64, 128, 512, 2048)
GROUP_SIZE = 32  # the runtime's default int4 group (hpi_runtime.quantization)
L2_BYTES = 120 << 20  # twice the H200's L2
CALLS_PER_GRAPH = 10


def l2_missing_copies(nbytes: int) -> int:
    """Copies of a weight of `nbytes` that together exceed the L2 (twice over)."""
    return max(1, -(-L2_BYTES // max(nbytes, 1)))


def graph_ms(fn, calls: list[tuple]) -> float:
    """GPU ms per call of fn(*args), CALLS_PER_GRAPH calls with args rotating through `calls`, in a CUDA graph."""
    return part.graph_ms([partial(fn, *calls[i % len(calls)]) for i in range(CALLS_PER_GRAPH)])


def variants(module) -> dict:
    """name -> fn(x, weights) for the quantized matmuls of `module` (this checkout's quant_matmul, or a baseline)."""
    out = {}
    if module is qm:
        out["int8"] = lambda x, w: qm.int8_weight_only_matmul(x, *w)
        out["int4"] = lambda x, w: qm.int4_weight_only_matmul(x, *w, GROUP_SIZE)

        def unsplit(kind: str):
            def fn(x, w):
                config = replace(qm.default_config(x.shape[0], w[0].shape[0], x.shape[1], x.dtype), split_k=1)
                if kind == "int8":
                    return qm.int8_weight_only_matmul(x, *w, config=config)
                return qm.int4_weight_only_matmul(x, *w, GROUP_SIZE, config=config)

            return fn

        out["int8_unsplit"], out["int4_unsplit"] = unsplit("int8"), unsplit("int4")
        out["int8_dequant"] = lambda x, w: x @ qm.dequantized_int8(*w, x.dtype).T
        out["int4_dequant"] = lambda x, w: x @ qm.dequantized_int4(*w, GROUP_SIZE, x.dtype).T
    else:
        out["int8_baseline"] = lambda x, w: module.int8_weight_only_matmul(x, *w)
        out["int4_baseline"] = lambda x, w: module.int4_weight_only_matmul(x, *w, GROUP_SIZE)
    return out


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("baseline_quant_matmul", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(budget_s: float, baseline: Path | None) -> dict:
    device = torch.device("cuda")
    deadline = time.perf_counter() + budget_s
    fns = variants(qm)
    if baseline is not None:
        fns.update(variants(load_module(baseline)))
    results: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                     "dequant_min_rows": qm.DEQUANT_MIN_ROWS, "group_size": GROUP_SIZE, "shapes": {}}  # fmt: skip
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        q8, s8 = quantize_int8(w)
        p4, s4, z4 = quantize_int4(w, GROUP_SIZE)
        weights = {"bf16": [(w.clone(),) for _ in range(l2_missing_copies(w.numel() * 2))],
                   "int8": [(q8.clone(), s8) for _ in range(l2_missing_copies(q8.numel()))],
                   "int4": [(p4.clone(), s4, z4) for _ in range(l2_missing_copies(p4.numel()))]}  # fmt: skip
        shape: dict = {"n": n, "k": k, "rows": {}}
        for m in ROWS:
            if time.perf_counter() > deadline:
                results.setdefault("cut", []).append(f"{name} from {m} rows: the budget ran out")
                break
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            row: dict = {"bf16_ms": graph_ms(lambda x, w: x @ w[0].T, [(x, wb) for wb in weights["bf16"]])}
            reference = x.float() @ w.float().T
            for key, fn in fns.items():
                calls = [(x, wq) for wq in weights[key[:4]]]
                try:
                    row[f"{key}_ms"] = graph_ms(fn, calls)
                    row[f"{key}_max_abs_err"] = (fn(*calls[0]).float() - reference).abs().max().item()
                except Exception as exc:  # recorded, and the other variants still run
                    row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            shape["rows"][str(m)] = row
        results["shapes"][name] = shape
        del weights
        torch.cuda.empty_cache()
    return results


def table(results: dict) -> str:
    keys = sorted({key[:-3] for shape in results["shapes"].values() for row in shape["rows"].values()
                   for key in row if key.endswith("_ms") and key != "bf16_ms"})  # fmt: skip
    lines = [f"{results['device']}, torch {results['torch']}: bf16 torch.matmul ms, and its time over each variant's "
             "(x > 1: faster than bf16)",
             "| shape | rows | bf16 ms | " + " | ".join(keys) + " |", "|---|---|---|" + "---|" * len(keys)]  # fmt: skip
    for name, shape in results["shapes"].items():
        for m, row in shape["rows"].items():
            base = row["bf16_ms"]
            cells = [f"{base / row[f'{key}_ms']:.2f}x" if f"{key}_ms" in row else "-" for key in keys]
            lines.append(f"| {name} | {m} | {base:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds; rows left when it runs out are cut")
    parser.add_argument("--baseline-module", type=Path, default=None, help="an earlier quant_matmul.py to compare")
    args = parser.parse_args()
    results = run(args.budget, args.baseline_module)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
