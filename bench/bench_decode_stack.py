"""The CPU decode step through hpi_kernels' DecodeStack (all layers in one C++ call: worker/cpu_decode.py) against
the same step through the compiled model (Inductor's graph, the runtime's default before it), on the embedded
SmolLM2-135M-Instruct, unquantized and int8/int4 (with the int8 LM head, as served with --quantize-lm-head).

For each weight kind one executor of each kind is built; then for each batch size N requests with 100-token
prompts are prefilled and decoded together (bench/step_driver.py's DecodeDriver: no scheduler, no process
boundary), the two executors taking turns in blocks of steps, --rounds blocks each. Prints the median decode
step and the median model forward (the runner's `_run_model`: the layers, without LM head, sampler and input
preparation) of each, and the ratio compiled / stack; writes bench/results/decode_stack.json.

    .venv/bin/python -m bench.bench_decode_stack --quantization none int8 int4 --batch 1 8 32 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.report import machine_description
from bench.step_driver import BLOCK_SIZE, DecodeDriver
from hpi_runtime.config import CacheConfig
from hpi_runtime.embedded import ensure_embedded_model
from hpi_runtime.models.config import load_model_config
from hpi_runtime.quantization.quantize import QuantizationConfig
from hpi_runtime.worker.executor import ExecutorConfig, LocalExecutor

PROMPT_LEN = 100


class Timed:
    """An executor and the model-forward times of its runner (its `_run_model` wrapped)."""

    def __init__(self, executor: LocalExecutor) -> None:
        self.executor, self.model_ms = executor, []
        run_model = executor.runner._run_model

        def timed(step):
            start = time.perf_counter()
            hidden = run_model(step)
            self.model_ms.append((time.perf_counter() - start) * 1e3)
            return hidden

        executor.runner._run_model = timed


def _executor(quantization: str, dtype: torch.dtype, stack: bool, max_batch: int) -> Timed:
    quant = QuantizationConfig(method=quantization, quantize_lm_head=True) if quantization != "none" else None
    kv_bytes = max(256 << 20, max_batch * 512 * 30 * 2 * 192 * dtype.itemsize)  # 512 tokens a request (30 layers)
    config = ExecutorConfig(model_config=load_model_config(ensure_embedded_model()), dtype=dtype,
                            device=torch.device("cpu"), max_model_len=2048,
                            cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=kv_bytes),
                            quantization=quant or QuantizationConfig(), cpu_decode_stack=stack,
                            max_num_seqs=max(64, max_batch))  # fmt: skip
    return Timed(LocalExecutor(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=5, help="blocks of steps per executor and batch size")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode_stack.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    results = []
    for quantization in args.quantization:
        ways = {"stack": _executor(quantization, dtype, True, max(args.batch)),
                "compiled": _executor(quantization, dtype, False, max(args.batch))}  # fmt: skip
        assert ways["stack"].executor.runner.cpu_decode is not None, "the stack declined the embedded model"
        for batch in args.batch:
            drivers = {name: DecodeDriver(w.executor, batch, PROMPT_LEN, tag=f"{quantization}-{batch}")
                       for name, w in ways.items()}  # fmt: skip
            for name, driver in drivers.items():
                driver.prefill()
                ways[name].model_ms.clear()
            step_ms: dict[str, list[float]] = {name: [] for name in ways}
            block = 30 if batch < 16 else 8
            for _ in range(args.rounds):
                for name, driver in drivers.items():
                    for _ in range(block):
                        start = time.perf_counter()
                        driver.decode()
                        step_ms[name].append((time.perf_counter() - start) * 1e3)
            row = {"quantization": quantization, "dtype": args.dtype, "batch": batch}
            for name, way in ways.items():
                row[f"{name}_step_ms"] = statistics.median(step_ms[name])
                row[f"{name}_model_ms"] = statistics.median(way.model_ms)
            row["compiled_over_stack"] = row["compiled_step_ms"] / row["stack_step_ms"]
            results.append(row)
            print(f"{quantization:>5} {args.dtype} batch {batch:3d}: step stack {row['stack_step_ms']:.2f} ms / "
                  f"compiled {row['compiled_step_ms']:.2f} ms = {row['compiled_over_stack']:.2f}x; model "
                  f"{row['stack_model_ms']:.2f} / {row['compiled_model_ms']:.2f} ms", flush=True)  # fmt: skip
            for way in ways.values():
                way.executor.runner.input_batch.clear()
    args.out.write_text(json.dumps({"machine": machine_description(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
