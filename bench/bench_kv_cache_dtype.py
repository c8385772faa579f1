"""KV cache element type (`hpi serve --kv-cache-dtype`): served throughput and latency, the tokens a KV budget holds,
and perplexity, for the model's dtype ("auto") against bf16 (for an fp32 model) and the one-byte fp8 caches, side by
side on one machine.

Served: per round, one `hpi serve` per KV dtype (the order alternating between rounds), each driven by closed-loop
streaming clients at every concurrency (fixed prompt and output lengths, EOS ignored, the same seeded requests for
every dtype); the ratios are against "auto" in the same round, and the table shows their medians. Capacity: the
server's own `hpi:kv_cache_blocks` for one `--kv-cache-memory`. Quality: perplexity of the embedded model on the
text the quantization tests ship, in one prefill and in 64-token chunks (every query reads its keys and values back
from the cache, the text's own included), in process.

    .venv/bin/python -m bench.bench_kv_cache_dtype --rounds 2 -- --quantization int4 --quantize-lm-head
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from bench.bench_quantization import PERPLEXITY_CHUNK, TEXT_PATH
from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.report import machine_description
from bench.systems import SERVED_MODEL_NAME, ServerProcess, hpi_command, metric_value
from hpi_runtime.model_source import resolve_model_dir
from hpi_runtime.worker.executor import KV_TORCH_DTYPES

KV_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")
TORCH_KV_DTYPES = {"auto": None, **KV_TORCH_DTYPES}  # the runtime's own mapping; None: the model's dtype


def served_round(kv_dtypes: list[str], hpi_args: list[str], concurrency: list[int], requests_per_client: int,
                 prompt_len: int, output_len: int, kv_memory: str, threads: int, log_dir: Path) -> dict:  # fmt: skip
    model_dir, _ = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = {}
    for kv in kv_dtypes:
        command = hpi_command(threads, *hpi_args, "--kv-cache-dtype", kv, "--kv-cache-memory", kv_memory)
        with ServerProcess(command, log_dir / f"hpi-{kv}.log") as server:
            blocks = metric_value(server.metrics_text(), "hpi:kv_cache_blocks")
            warm = WorkloadSpec(2, LengthDist(16), LengthDist(8), seed=999)
            asyncio.run(run_load(build_requests(tokenizer, warm), LoadConfig(server.base_url, SERVED_MODEL_NAME, 2)))
            runs = {}
            for i, n in enumerate(concurrency):
                spec = WorkloadSpec(n * requests_per_client, LengthDist(prompt_len), LengthDist(output_len), 100 + i)
                config = LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=n, seed=100 + i)
                summary = summarize(asyncio.run(run_load(build_requests(tokenizer, spec), config)))
                summary.pop("samples")
                runs[n] = summary
                print(f"  {kv:>9} N={n:<3} {summary['output_tokens_per_s']:7.1f} tok/s  TTFT p50 "
                      f"{summary['ttft_ms']['p50']:7.0f} ms  ITL p50 {summary['itl_ms']['p50']:6.1f} ms  "
                      f"errors {summary['num_errors']}", flush=True)
        rows[kv] = {"kv_cache_blocks": blocks, "runs": runs}
    return rows


def quality(kv_dtypes: list[str], hpi_args: list[str]) -> dict:
    """Perplexity per KV dtype on one eager engine with the served options (its private caches swapped per dtype)."""
    from hpi_runtime.cli import build_parser
    from hpi_runtime.config import engine_options
    from hpi_runtime.evaluation.perplexity import perplexity
    from hpi_runtime.llm import LLM

    parsed = build_parser().parse_args(["serve", *hpi_args, "--enforce-eager"])  # the flags as `hpi serve` reads them
    options = {spec.name: getattr(parsed, spec.name) for spec in engine_options()}
    llm = LLM(options.pop("model"), **options)
    ids = llm.tokenizer.encode(TEXT_PATH.read_text())
    executor = llm.engine.executor
    out = {}
    for kv in kv_dtypes:
        cache = TORCH_KV_DTYPES[kv]
        out[kv] = {"perplexity": perplexity(executor.model, executor.runner.backend, ids, kv_cache_dtype=cache),
                   "perplexity_chunked": perplexity(executor.model, executor.runner.backend, ids, PERPLEXITY_CHUNK,
                                                    kv_cache_dtype=cache)}  # fmt: skip
        print(f"  {kv:>9} perplexity {out[kv]['perplexity']:.3f}, {PERPLEXITY_CHUNK}-token chunks "
              f"{out[kv]['perplexity_chunked']:.3f}", flush=True)
    llm.shutdown()
    return out


def table(rounds: list[dict], ppl: dict, kv_dtypes: list[str], concurrency: list[int]) -> str:
    lines = ["| KV dtype | KV blocks (same budget) | clients | output tok/s (median) | x auto (per round) | "
             "TTFT p50 ms | ITL p50 ms | perplexity | chunked |", "| --- " * 9 + "|"]  # fmt: skip
    for kv in kv_dtypes:
        for n in concurrency:
            tok = [r[kv]["runs"][n]["output_tokens_per_s"] for r in rounds]
            ratios = [r[kv]["runs"][n]["output_tokens_per_s"] / r["auto"]["runs"][n]["output_tokens_per_s"]
                      for r in rounds]  # fmt: skip
            ttft = statistics.median(r[kv]["runs"][n]["ttft_ms"]["p50"] for r in rounds)
            itl = statistics.median(r[kv]["runs"][n]["itl_ms"]["p50"] for r in rounds)
            lines.append(f"| {kv} | {int(rounds[0][kv]['kv_cache_blocks'])} | {n} | {statistics.median(tok):.1f} | "
                         f"**{statistics.median(ratios):.2f}** ({', '.join(f'{x:.2f}' for x in ratios)}) | "
                         f"{ttft:.0f} | {itl:.1f} | {ppl[kv]['perplexity']:.3f} | "
                         f"{ppl[kv]['perplexity_chunked']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-dtypes", nargs="+", default=["auto", "fp8_e4m3", "fp8_e5m2"], choices=KV_DTYPES)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="the same KV budget for every dtype")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("hpi_args", nargs="*", help="extra `hpi serve` arguments (after --)")
    args = parser.parse_args()
    if "auto" not in args.kv_dtypes:
        parser.error("--kv-dtypes must include auto: the ratios are against it")
    machine = machine_description()
    print(f"{machine['cpu_model']}, {machine['num_cpus']} cores, {' '.join(machine['cpu_flags'])}; "
          f"hpi serve {' '.join(args.hpi_args)}", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = args.kv_dtypes if r % 2 == 0 else args.kv_dtypes[::-1]
            print(f"round {r + 1}: load average {os.getloadavg()[0]:.1f}", flush=True)
            rounds.append(served_round(order, args.hpi_args, args.concurrency, args.requests_per_client,
                                       args.prompt_len, args.output_len, args.kv_cache_memory, args.threads,
                                       Path(tmp)))  # fmt: skip
    print("quality:", flush=True)
    ppl = quality(args.kv_dtypes, args.hpi_args)
    print(table(rounds, ppl, args.kv_dtypes, args.concurrency))
    if args.json:
        payload = {"started": started, "machine": machine, "hpi_args": args.hpi_args, "kv_cache_memory":
                   args.kv_cache_memory, "prompt_len": args.prompt_len, "output_len": args.output_len,
                   "rounds": rounds, "perplexity": ppl, "load_average_end": os.getloadavg()[0]}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
