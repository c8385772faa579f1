"""`make bench` / `python -m bench`: the whole suite, written to bench/results/ (JSON, Markdown, PNGs).

Sections, in order: the machine's matmul peak (roofline), the serving comparison (hpi vs transformers at its
faster dtype vs llama.cpp's C++ server; two rounds in alternating order, ratios their median), the prefix-cache
comparison, engine-core micro-benchmarks (no model). `--quick` runs every section at toy sizes, one round, into
bench/results/tmp/ (a smoke test of the suite, not numbers to keep).

    .venv/bin/python -m bench                                  # the full suite (~20 min on 2 cores)
    .venv/bin/python -m bench --quick                          # seconds-to-minutes smoke run
    .venv/bin/python -m bench --sections serving --systems hpi llama.cpp --concurrency 1 32
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.prefix_cache import PrefixPlan, run_prefix_cache
from bench.report import machine_description, write_report
from bench.roofline import matmul_peak, model_flops_per_token
from bench.serving import SYSTEMS, ServingPlan, run_rounds
from bench.systems import REPO_ROOT, llama_python

SECTIONS = ("roofline", "serving", "prefix", "engine")
QUICK_SERVING = ServingPlan(concurrencies=(1, 4), llama_concurrencies=(1, 4), tf_batch_sizes=(1, 4), output_len=8,
                            prompt_len=32, min_requests=2, requests_per_client=1, open_loop_requests=4)
QUICK_PREFIX = PrefixPlan(shared_len=64, unique_len=8, output_len=4, num_requests=4, concurrency=2)


def engine_core(quick: bool) -> dict:
    """bench_engine_core.py's measurements as data (the script itself prints them as Markdown)."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from bench import bench_engine_core as core
    from hpi_testing.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    step_cost = []
    for num_running in (16,) if quick else (64, 256):
        steps = dict(num_steps=5, num_windows=1) if quick else {}
        step_cost.append({"num_running": num_running, "us_per_step": core.step_cost_us(num_running, **steps),
                          "us_per_step_detok": core.step_cost_us(num_running, tokenizer, **steps)})
    max_model_len, block_size = 2048, 16
    budget_tokens = 16 * max_model_len
    result = core.run_mixed(budget_tokens // block_size, max_model_len, core.mixed_workload(100 if quick else 1500),
                            block_size)
    return {"step_cost": step_cost, "kv": {
        "budget_tokens": budget_tokens, "max_model_len": max_model_len, "waste": result["waste"],
        "paged_running": result["mean_running"], "contiguous_running": budget_tokens // max_model_len,
        "preemptions": result["preemptions"]}}


def roofline_summary(peaks: dict, flops: dict, serving: dict, hpi_dtype: str) -> dict:
    """The measured peaks, and hpi's achieved FLOP/s at its best closed-loop point (over the rounds) against them."""
    out = {"peaks": peaks, **flops, "hpi_dtype": hpi_dtype}
    runs = [run for one_round in serving.get("rounds", [serving])
            for run in (one_round.get("hpi") or {}).get("closed_loop", [])]  # fmt: skip
    if runs and hpi_dtype in peaks:
        best = max(runs, key=lambda r: r["total_tokens_per_s"])
        achieved = best["total_tokens_per_s"] * flops["linear_flops_per_token"] / 1e9
        out.update(hpi_concurrency=best["concurrency"], hpi_total_tokens_per_s=best["total_tokens_per_s"],
                   hpi_achieved_gflops=achieved, peak_gflops=peaks[hpi_dtype]["peak_gflops"],
                   hpi_fraction_of_peak=achieved / peaks[hpi_dtype]["peak_gflops"])
    return out


def main() -> None:
    from hpi_runtime.engine_factory import resolve_dtype
    from hpi_runtime.model_source import resolve_model_dir

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes, results under bench/results/tmp/")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--rounds", type=int, help="serving rounds, in alternating order (default 2; --quick 1)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="hpi's closed-loop sweep")
    parser.add_argument("--llama-concurrency", type=int, nargs="+")
    parser.add_argument("--tf-batch-sizes", type=int, nargs="+")
    parser.add_argument("--requests-per-client", type=float)
    parser.add_argument("--hpi-args", default="", help="more `hpi serve` flags, e.g. '--quantization int4'")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    plan, prefix_plan = (QUICK_SERVING, QUICK_PREFIX) if args.quick else (ServingPlan(), PrefixPlan())
    overrides = {"concurrencies": args.concurrency, "llama_concurrencies": args.llama_concurrency,
                 "tf_batch_sizes": args.tf_batch_sizes, "requests_per_client": args.requests_per_client,
                 "hpi_args": shlex.split(args.hpi_args)}
    plan = replace(plan, **{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items() if v})
    out_dir = args.out_dir or REPO_ROOT / "bench" / ("results/tmp" if args.quick else "results")
    log_dir = REPO_ROOT / "bench" / "results" / "tmp" / "logs"
    torch.set_num_threads(plan.num_threads)

    t_start = time.monotonic()

    def progress(message: str) -> None:
        print(f"[bench {time.monotonic() - t_start:6.0f} s] {message}", flush=True)

    model_dir, _ = resolve_model_dir(None)
    hpi_dtype = str(resolve_dtype("auto", torch.device("cpu"), "float32")).removeprefix("torch.")
    results: dict = {"machine": machine_description(llama_python()), "skipped": {}}
    partial = log_dir.parent / "partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)

    def checkpoint() -> None:  # a crash late in the suite keeps what was measured before it
        partial.write_text(json.dumps(results, indent=1))

    peaks = {}
    if "roofline" in args.sections:
        peaks = matmul_peak(model_dir, min_time_s=0.05 if args.quick else 0.4)
        progress("matmul peak: " + ", ".join(f"{d} {p['peak_gflops']:.0f} GFLOP/s" for d, p in peaks.items()))
    if "serving" in args.sections:
        rounds = args.rounds or (1 if args.quick else 2)
        results["serving"] = run_rounds(plan, model_dir, getattr(torch, hpi_dtype), log_dir, progress,
                                        tuple(args.systems), rounds)
        for one_round in results["serving"].get("rounds", [results["serving"]]):
            if "skipped" in (one_round.get("llama.cpp") or {}):
                results["skipped"]["llama.cpp"] = one_round.pop("llama.cpp")["skipped"]
        checkpoint()
    if peaks:
        results["roofline"] = roofline_summary(peaks, model_flops_per_token(model_dir), results.get("serving") or {},
                                               hpi_dtype)
    if "prefix" in args.sections:
        results["prefix_cache"] = run_prefix_cache(prefix_plan, model_dir, log_dir, progress)
        checkpoint()
    # Last: it measures CPU time (thread_time), so it is the section a busy machine disturbs least.
    if "engine" in args.sections:
        results["engine_core"] = engine_core(args.quick)
        progress(f"engine core: {results['engine_core']['step_cost']}")
        checkpoint()
    results["wall_s"] = time.monotonic() - t_start
    for path in write_report(results, out_dir):
        progress(f"wrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}")


if __name__ == "__main__":
    main()
