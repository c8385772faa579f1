"""Continuous vs static batching when outputs differ in length: hpi against transformers `generate`.

The suite's serving comparison forces every request to the same output length, the one workload where a
static batch wastes nothing. Real requests end at different lengths. Here each request asks for its own
number of tokens (uniform, 16-240 by default; EOS ignored so the counts are exact), the same requests for
both systems:
- hpi: `hpi serve`, a closed loop of N clients; a finished request's slot is refilled at the next step.
- transformers: static batches of N in arrival order, each generating until its longest request is done
  (what a static batcher must do); only the tokens each request asked for count as output.

    .venv/bin/python -m bench.bench_variable_lengths                       # N = 64, 128 requests
Writes bench/results/variable_lengths.json and .md (--out to change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import torch

from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.report import machine_description
from bench.systems import REPO_ROOT, SERVED_MODEL_NAME, ServerProcess, TransformersBaseline, hpi_command


def run_hpi(requests, tokenizer, args: argparse.Namespace, log_dir: Path) -> dict:
    command = hpi_command(args.threads, "--kv-cache-memory", "1GiB", "--max-num-seqs", str(args.concurrency),
                          "--dtype", args.dtype)  # fmt: skip
    with ServerProcess(command, log_dir / "hpi-variable.log") as server:
        warm = build_requests(tokenizer, WorkloadSpec(2, LengthDist(32), LengthDist(4), seed=99_999))
        asyncio.run(run_load(warm, LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=2)))
        run = asyncio.run(run_load(requests, LoadConfig(server.base_url, SERVED_MODEL_NAME,
                                                        concurrency=args.concurrency)))  # fmt: skip
    summary = {k: v for k, v in summarize(run).items() if k != "samples"}
    return {"output_tokens_per_s": summary["output_tokens_per_s"], "duration_s": summary["duration_s"],
            "num_errors": summary["num_errors"], "e2e_ms": summary["e2e_ms"], "ttft_ms": summary["ttft_ms"]}


def run_transformers(requests, tokenizer, args: argparse.Namespace, model_dir: Path) -> dict:
    baseline = TransformersBaseline(model_dir, getattr(torch, args.dtype))
    prompt_ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    if len({len(p) for p in prompt_ids}) != 1:
        raise ValueError("prompts must share one length (no padding)")
    useful = generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), args.concurrency):
        batch = torch.tensor(prompt_ids[i : i + args.concurrency])
        lengths = [r.max_tokens for r in requests[i : i + args.concurrency]]
        with torch.inference_mode():
            out = baseline.model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=max(lengths),
                                          min_new_tokens=max(lengths), do_sample=False,
                                          pad_token_id=baseline.pad_token_id)  # fmt: skip
        assert out.shape[1] - batch.shape[1] == max(lengths)
        useful += sum(lengths)
        generated += max(lengths) * len(lengths)
    duration_s = time.perf_counter() - start
    return {"output_tokens_per_s": useful / duration_s, "duration_s": duration_s,
            "wasted_fraction": 1 - useful / generated}  # fmt: skip


def main() -> None:
    from transformers import AutoTokenizer

    from hpi_runtime.model_source import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-mean", type=int, default=128)
    parser.add_argument("--output-spread", type=float, default=0.875, help="uniform in mean*(1 +- spread)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None)[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = WorkloadSpec(args.num_requests, LengthDist(args.prompt_len),
                        LengthDist(args.output_mean, "uniform", args.output_spread), seed=4242)  # fmt: skip
    requests = build_requests(tokenizer, spec)
    hpi = run_hpi(requests, tokenizer, args, args.out / "logs")
    print(f"hpi: {hpi['output_tokens_per_s']:.1f} output tok/s", flush=True)
    tf = run_transformers(requests, tokenizer, args, model_dir)
    print(f"transformers: {tf['output_tokens_per_s']:.1f} output tok/s ({tf['wasted_fraction']:.0%} wasted)")
    lengths = [r.max_tokens for r in requests]
    results = {"machine": machine_description(), "concurrency": args.concurrency, "num_requests": len(requests),
               "prompt_len": args.prompt_len, "output_len": {"min": min(lengths), "max": max(lengths),
               "mean": sum(lengths) / len(lengths)}, "dtype": args.dtype, "hpi": hpi, "transformers": tf,
               "hpi_over_transformers": hpi["output_tokens_per_s"] / tf["output_tokens_per_s"]}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "variable_lengths.json").write_text(json.dumps(results, indent=1) + "\n")
    machine = ", ".join(f"{k}: {v}" for k, v in results["machine"].items())
    md = (f"# Variable output lengths: continuous vs static batching\n\n{machine}\n\n"
          f"{len(requests)} requests, {args.prompt_len}-token prompts, outputs {min(lengths)}-{max(lengths)} tokens "
          f"(mean {results['output_len']['mean']:.0f}), {args.concurrency} clients / batch {args.concurrency}, "
          f"{args.dtype}, greedy, EOS ignored.\n\n"
          "| system | output tok/s | x transformers | note |\n|---|---:|---:|---|\n"
          f"| hpi serve | {hpi['output_tokens_per_s']:.1f} | {results['hpi_over_transformers']:.2f}x | "
          f"{hpi['num_errors']} errors, e2e p50 {hpi['e2e_ms']['p50']:.0f} ms |\n"
          f"| transformers generate (static) | {tf['output_tokens_per_s']:.1f} | 1.00x | "
          f"{tf['wasted_fraction']:.0%} of generated tokens past a request's length |\n")  # fmt: skip
    (args.out / "variable_lengths.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
