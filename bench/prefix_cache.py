"""Prefix-cache benchmark: a shared-system-prompt workload against `hpi serve` with caching on, then off.

Every request is one long system prompt (the same text) plus a short unique question; with prefix caching
the prompt's full blocks are computed once and reused, so only the unique tail is prefilled. Reports TTFT
percentiles and throughput for both runs, their ratios, and the server's own prefix-cache hit rate.

    .venv/bin/python -m bench.prefix_cache --shared-len 512 --num-requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.systems import SERVED_MODEL_NAME, ServerProcess, hpi_command, metric_value


@dataclass(frozen=True)
class PrefixPlan:
    shared_len: int = 512  # tokens of the common system prompt
    unique_len: int = 32
    output_len: int = 32
    num_requests: int = 24
    concurrency: int = 4
    num_threads: int = 2
    seed: int = 0


def _run(plan: PrefixPlan, tokenizer, caching: bool, log_dir: Path) -> dict:
    spec = WorkloadSpec(plan.num_requests, LengthDist(plan.unique_len), LengthDist(plan.output_len), plan.seed,
                        shared_prefix_len=plan.shared_len)
    requests = build_requests(tokenizer, spec)
    extra = () if caching else ("--no-prefix-caching",)
    command = hpi_command(plan.num_threads, "--kv-cache-memory", "1GiB", *extra)
    with ServerProcess(command, log_dir / f"hpi-prefix-{'on' if caching else 'off'}.log") as server:
        # Warm-up on an unrelated prompt: first-call costs out, and the shared prefix still uncached.
        warm = build_requests(tokenizer, WorkloadSpec(1, LengthDist(plan.unique_len), LengthDist(4), seed=99_999))
        asyncio.run(run_load(warm, LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=1)))
        before = server.metrics_text()
        config = LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=plan.concurrency)
        summary = summarize(asyncio.run(run_load(requests, config)))
        after = server.metrics_text()
    queries = metric_value(after, "vllm:prefix_cache_queries_total") - metric_value(
        before, "vllm:prefix_cache_queries_total")
    hits = metric_value(after, "vllm:prefix_cache_hits_total") - metric_value(before, "vllm:prefix_cache_hits_total")
    summary["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
    return summary


def run_prefix_cache(plan: PrefixPlan, model_dir: Path, log_dir: Path, progress=print) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    on = _run(plan, tokenizer, True, log_dir)
    progress(f"prefix caching on: TTFT p50 {on['ttft_ms']['p50']:.0f} ms, hit rate {on['prefix_cache_hit_rate']:.2f}")
    off = _run(plan, tokenizer, False, log_dir)
    progress(f"prefix caching off: TTFT p50 {off['ttft_ms']['p50']:.0f} ms")
    return {
        "plan": asdict(plan),
        "on": on,
        "off": off,
        "ttft_p50_speedup": off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"],
        "ttft_p90_speedup": off["ttft_ms"]["p90"] / on["ttft_ms"]["p90"],
        "throughput_speedup": on["output_tokens_per_s"] / off["output_tokens_per_s"],
    }


def main() -> None:
    from hpi_runtime.model_source import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in asdict(PrefixPlan()).items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    plan = PrefixPlan(**vars(parser.parse_args()))
    model_dir, _ = resolve_model_dir(None)
    result = run_prefix_cache(plan, model_dir, Path("bench/results/tmp"))
    for key in ("on", "off"):
        result[key].pop("samples")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
