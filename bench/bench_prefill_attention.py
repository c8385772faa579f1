"""Prefill attention's tiles on a CPU with AMX: time to first token of one long prompt, and the batched prefill
step, on the embedded SmolLM2-135M in bf16 through the offline `LLM` (prefix caching off), with the prefill
attention on the vector tile and on AMX tiles (hpi_kernels.cpu.prefill_attention_tile) alternating in one
process, --rounds rounds. Per prompt length the best of --repeats single-prompt generations (max_tokens 1: the
prefill and one sampled token), then a batch of 32 prompts of 64 tokens (one 2,048-token prefill step). Prints
JSON with the machine's ISA; ratios are vector / amx.

    .venv/bin/python -m bench.bench_prefill_attention --json bench/results/prefill_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.report import machine_description
from hpi_kernels.cpu import prefill_attention_tile
from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams

TILES = ("vector", "amx")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto", help="the cache's element type (auto: bf16, fp8...)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if prefill_attention_tile() != "amx":
        raise SystemExit("this CPU has no AMX-BF16 tiles: only the vector tile runs here")
    generator = torch.Generator().manual_seed(0)
    llm = LLM(None, dtype="bfloat16", enable_prefix_caching=False, max_model_len=max(args.lengths) + 16,
              kv_cache_dtype=args.kv_cache_dtype)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompt(length: int) -> list[int]:
        return torch.randint(100, 40000, (length,), generator=generator).tolist()

    def timed(prompts: list[list[int]]) -> float:
        start = time.perf_counter()
        llm.generate(prompts, one)
        return (time.perf_counter() - start) * 1000

    llm.generate([prompt(64)], one)  # first-call costs
    results: dict[str, dict[str, list[float]]] = {tile: {} for tile in TILES}
    for round_index in range(args.rounds):
        for tile in TILES if round_index % 2 == 0 else reversed(TILES):
            prefill_attention_tile(tile)
            for length in args.lengths:
                best = min(timed([prompt(length)]) for _ in range(args.repeats))
                results[tile].setdefault(f"ttft_ms_{length}", []).append(round(best, 1))
            best = min(timed([prompt(64) for _ in range(32)]) for _ in range(args.repeats))
            results[tile].setdefault("batch_32x64_ms", []).append(round(best, 1))
    prefill_attention_tile("amx")
    ratios = {key: round(statistics.median(results["vector"][key]) / statistics.median(results["amx"][key]), 2)
              for key in results["amx"]}  # fmt: skip
    report = {"machine": machine_description(), "kv_cache_dtype": args.kv_cache_dtype, "results": results,
              "vector_over_amx": ratios}  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
