"""Tensor parallelism: `hpi serve` at tp 1 and tp N side by side on the same machine, requests and threads.

On one CPU the ranks share the cores (each gets cores / N threads) and pay a gloo all-reduce twice per
layer plus the pipe round trip per step, so expect no gain there: the point of the CPU run is that TP
costs little. On GPUs each rank brings its own device.

    .venv/bin/python -m bench.bench_tensor_parallel                        # CPU, embedded model, tp 1 vs 2
    .venv/bin/python -m bench.bench_tensor_parallel --device cuda --tp 1 2 --dtype bfloat16
Writes bench/results/tensor_parallel.json and .md (--out to change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.report import machine_description
from bench.systems import REPO_ROOT, SERVED_MODEL_NAME, ServerProcess, hpi_command


def measure(tp_size: int, args: argparse.Namespace, tokenizer, log_dir: Path) -> list[dict]:
    extra = ["--tensor-parallel-size", str(tp_size), "--dtype", args.dtype, "--device", args.device,
             "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(max(args.concurrency))]  # fmt: skip
    if args.model:
        extra += ["--model", args.model]
    runs = []
    with ServerProcess(hpi_command(args.threads, *extra), log_dir / f"hpi-tp{tp_size}.log") as server:
        warm = build_requests(tokenizer, WorkloadSpec(2, LengthDist(args.prompt_len), LengthDist(4), seed=99_999))
        asyncio.run(run_load(warm, LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=2)))
        for concurrency in args.concurrency:
            # The same seed for every tp size: identical requests; a fresh seed per concurrency level keeps
            # the prefix cache from serving one level from the previous one.
            spec = WorkloadSpec(max(2 * concurrency, 4), LengthDist(args.prompt_len), LengthDist(args.output_len),
                                seed=concurrency)  # fmt: skip
            run = asyncio.run(run_load(build_requests(tokenizer, spec),
                                       LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=concurrency)))
            summary = {"tp": tp_size, **{k: v for k, v in summarize(run).items() if k != "samples"}}
            print(f"tp {tp_size} N={concurrency}: {summary['output_tokens_per_s']:.1f} output tok/s, "
                  f"ITL p50 {summary['itl_ms']['p50']:.1f} ms, errors {summary['num_errors']}", flush=True)
            runs.append(summary)
    return runs


def markdown(results: dict) -> str:
    base = {r["concurrency"]: r for r in results["runs"] if r["tp"] == results["tp_sizes"][0]}
    machine = ", ".join(f"{key}: {value}" for key, value in results["machine"].items())
    lines = [f"# Tensor parallelism ({results['device']}, {results['dtype']})", "", machine, "",
             "| tp | clients | output tok/s | vs tp 1 | TTFT p50 ms | ITL p50 ms | errors |",
             "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results["runs"]:
        ratio = r["output_tokens_per_s"] / base[r["concurrency"]]["output_tokens_per_s"]
        lines.append(f"| {r['tp']} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | {ratio:.2f}x | "
                     f"{r['ttft_ms']['p50']:.0f} | {r['itl_ms']['p50']:.1f} | {r['num_errors']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from transformers import AutoTokenizer

    from hpi_runtime.model_source import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory; default: the embedded model")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OMP threads of the server")
    parser.add_argument("--kv-cache-memory", default="512MiB", help="per rank")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model)[0])
    log_dir = args.out / "logs"
    runs = [r for tp in args.tp for r in measure(tp, args, tokenizer, log_dir)]
    results = {"machine": machine_description(), "device": args.device, "dtype": args.dtype, "tp_sizes": args.tp,
               "prompt_len": args.prompt_len, "output_len": args.output_len, "runs": runs}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tensor_parallel.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "tensor_parallel.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
