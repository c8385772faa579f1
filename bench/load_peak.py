"""Peak memory of loading a quantized model: the float model loaded whole and then quantized (the runtime before
2026-12-05) against each decoder layer quantized as it is read (models/loader.py's _load_layer_by_layer, the
executor's path now). Each variant loads the embedded model in a child process of its own, alternating, while a
thread samples the process's anonymous resident memory (RssAnon: the heap and the tensors, not the checkpoint's
mapped file pages) every 0.5 ms; prints the peak and what is left after the load, over the child's start.

    .venv/bin/python -m bench.load_peak --rounds 3 --out bench/results/load_peak.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.report import machine_description

VARIANTS = ("whole", "layer by layer")


def _anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def _child(variant: str, method: str, dtype_name: str) -> None:
    import torch

    from hpi_runtime.attention.torch_backend import TorchAttentionBackend
    from hpi_runtime.embedded import ensure_embedded_model
    from hpi_runtime.models.config import load_model_config
    from hpi_runtime.models.loader import load_model
    from hpi_runtime.quantization.quantize import QuantizationConfig, quantize_model

    dtype, config = getattr(torch, dtype_name), load_model_config(ensure_embedded_model())
    quantization, cpu = QuantizationConfig(method=method), torch.device("cpu")
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anonymous_bytes())
            time.sleep(0.0005)

    start = _anonymous_bytes()
    watcher = threading.Thread(target=watch)
    watcher.start()
    if variant == "whole":
        quantize_model(load_model(config, dtype, cpu, TorchAttentionBackend(dtype)), quantization)
    else:
        load_model(config, dtype, cpu, TorchAttentionBackend(dtype),
                   after_layer=lambda model, layer: quantize_model(model, quantization, layer))  # fmt: skip
    done.set()
    watcher.join()
    peak[0] = max(peak[0], _anonymous_bytes())
    print(json.dumps({"peak_mib": (peak[0] - start) / 2**20, "after_mib": (_anonymous_bytes() - start) / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["int8", "int4"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(*args.child)
    results = []
    for dtype in args.dtypes:
        for method in args.methods:
            runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for round_ in range(args.rounds):
                for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
                    out = subprocess.run([sys.executable, "-m", "bench.load_peak", "--child", variant, method, dtype],
                                         check=True, capture_output=True, text=True).stdout  # fmt: skip
                    runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            row = {"dtype": dtype, "method": method}
            for variant, measured in runs.items():
                key = variant.replace(" ", "_")
                row[f"{key}_peak_mib"] = statistics.median(m["peak_mib"] for m in measured)
                row[f"{key}_after_mib"] = statistics.median(m["after_mib"] for m in measured)
            results.append(row)
            print(f"{dtype} {method}: peak {row['whole_peak_mib']:.0f} -> {row['layer_by_layer_peak_mib']:.0f} MiB, "
                  f"after the load {row['whole_after_mib']:.0f} -> {row['layer_by_layer_after_mib']:.0f} MiB "
                  f"(medians of {args.rounds})", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_description(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
