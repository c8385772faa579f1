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
import shutil
import statistics
import subprocess
import sys
import tempfile
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


def _bf16_checkpoint(source: Path, target: Path) -> Path:
    """The embedded model with its weights stored in bf16, as most Hub checkpoints are (its own copy is fp32)."""
    import torch
    from safetensors.torch import load_file, save_file

    if not (target / "model.safetensors").exists():
        target.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.name not in ("model.safetensors", "config.json"):
                shutil.copy(path, target / path.name)
        config = json.loads((source / "config.json").read_text())
        config["dtype"] = config["torch_dtype"] = "bfloat16"
        (target / "config.json").write_text(json.dumps(config, indent=1))
        weights = load_file(source / "model.safetensors")
        save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, target / "model.safetensors")
    return target


def _child(variant: str, method: str, dtype_name: str, model_dir: str) -> None:
    import torch

    from hpi_runtime.attention.torch_backend import TorchAttentionBackend
    from hpi_runtime.models.config import load_model_config
    from hpi_runtime.models.cpu_layout import pack_cpu_weights
    from hpi_runtime.models.loader import load_model
    from hpi_runtime.quantization.quantize import QuantizationConfig, quantize_model

    dtype, config = getattr(torch, dtype_name), load_model_config(Path(model_dir))
    quantization, cpu = QuantizationConfig(method=method), torch.device("cpu")
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _anonymous_bytes())
            time.sleep(0.0005)

    start = _anonymous_bytes()
    watcher = threading.Thread(target=watch)
    watcher.start()
    if variant == "whole":  # the executor before: load, quantize, lay out for the CPU kernels
        model = quantize_model(load_model(config, dtype, cpu, TorchAttentionBackend(dtype)), quantization)
    else:  # the executor now (worker/executor.py's _build_model): each layer quantized and packed as it is read

        def after_layer(model, layer):
            quantize_model(model, quantization, layer)
            if layer is not None:
                pack_cpu_weights(model.get_submodule(layer))

        model = load_model(config, dtype, cpu, TorchAttentionBackend(dtype), after_layer=after_layer)
    pack_cpu_weights(model)
    done.set()
    watcher.join()
    peak[0] = max(peak[0], _anonymous_bytes())
    print(json.dumps({"peak_mib": (peak[0] - start) / 2**20, "after_mib": (_anonymous_bytes() - start) / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--checkpoint-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the embedded checkpoint as stored (fp32), or a bf16 copy of it (what most Hub models "
                        "are: an fp32 model of it keeps its linears in bf16 panels)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(*args.child)
    from hpi_runtime.embedded import ensure_embedded_model

    model_dir = ensure_embedded_model()
    if args.checkpoint_dtype == "bfloat16":
        model_dir = _bf16_checkpoint(model_dir, Path(tempfile.gettempdir()) / "hpi-load-peak-bf16")
    results = []
    for dtype in args.dtypes:
        for method in args.methods:
            runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for round_ in range(args.rounds):
                for variant in VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]:
                    command = [sys.executable, "-m", "bench.load_peak", "--child", variant, method, dtype,
                               str(model_dir)]  # fmt: skip
                    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                    runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            row = {"checkpoint": args.checkpoint_dtype, "dtype": dtype, "method": method}
            for variant, measured in runs.items():
                key = variant.replace(" ", "_")
                row[f"{key}_peak_mib"] = statistics.median(m["peak_mib"] for m in measured)
                row[f"{key}_after_mib"] = statistics.median(m["after_mib"] for m in measured)
            results.append(row)
            print(f"{args.checkpoint_dtype} checkpoint, {dtype} {method}: peak {row['whole_peak_mib']:.0f} -> "
                  f"{row['layer_by_layer_peak_mib']:.0f} MiB, after the load {row['whole_after_mib']:.0f} -> "
                  f"{row['layer_by_layer_after_mib']:.0f} MiB (medians of {args.rounds})", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_description(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
