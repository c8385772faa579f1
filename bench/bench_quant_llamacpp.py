"""Quantized CPU serving head to head with llama.cpp: `hpi serve` unquantized, int8 and int4 against llama.cpp's
own C++ `llama-server` on F16, Q8_0 and Q4_0 GGUFs of the same checkpoint (bench/llamacpp_build.py makes them with
llama.cpp's converter and quantizer), at 1 and 32 closed-loop streaming clients, in alternating rounds on one
machine (one server at a time), with the CPU's ISA recorded. llama-server runs with `--parallel N` for N clients
(its continuous batching; its context is split among the slots, so `-c` is N times one request's), both with the
machine's cores as threads.

    .venv/bin/python -m bench.llamacpp_build                    # once: builds llama-server and the GGUFs
    .venv/bin/python -m bench.bench_quant_llamacpp --rounds 2   # writes bench/results/quant_llamacpp.json
    HPI_LLAMA_CPP_BUILD=build-no-amx .venv/bin/python -m bench.bench_quant_llamacpp ...  # the build without AMX
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 HPI_LLAMA_CPP_BUILD=build-avx2 \
        .venv/bin/python -m bench.bench_quant_llamacpp --hpi-dtype float32 ...  # both sides' AVX2 code paths
    .venv/bin/python -m bench.bench_quant_llamacpp --rounds 2 --weights int4 --hpi-kv-cache-dtype fp8 \
        --llama-cache-type q8_0 --out /tmp/q.json                # each side's one-byte KV cache
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from bench.llamacpp_build import QUANT_TYPES, build_variant, server_command
from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.report import machine_description
from bench.systems import SERVED_MODEL_NAME, ServerCommand, ServerProcess, hpi_command

RESULTS = Path(__file__).parent / "results"
# hpi's weight format -> the llama.cpp GGUF of the same bits per weight (near enough: Q4_0 keeps an fp16 scale per
# 32 weights, hpi's int4 a bf16 scale and zero per group of 32, with q/k/v at int8 (its mixed policy); Q8_0 per 32,
# hpi's int8 per output channel). llama.cpp's quantizer stores the tied embedding / LM head of both GGUFs as Q8_0:
# hpi's quantized variants run with --quantize-lm-head, which makes a tied head int8, to read the same head.
PAIRS = {"unquantized": "F16", "int8": "Q8_0", "int4": "Q4_0"}


@dataclass(frozen=True)
class Plan:
    concurrencies: tuple[int, ...] = (1, 32)
    rounds: int = 2
    prompt_len: int = 128
    output_len: int = 128
    requests_per_client: int = 2
    threads: int = os.cpu_count() or 2
    hpi_dtype: str = "auto"  # the runtime's choice: bf16 with AVX512-BF16 or AMX, else fp32
    # Each side's KV cache: hpi's --kv-cache-dtype, llama-server's -ctk/-ctv (q8_0 and q4_0 need its flash
    # attention, turned on with them). The defaults are both servers' own: the model's dtype and f16.
    hpi_kv_cache_dtype: str = "auto"
    llama_cache_type: str = "f16"
    # hpi's --int8-activations for its quantized runs: "int8" also puts int4's int8 q/k/v in W8A8 (as llama.cpp's
    # Q4_0 quantizes the activations of every layer), "auto" is the runtime's default
    hpi_int8_activations: str = "auto"
    weights: tuple[str, ...] = tuple(PAIRS)  # the pairs to run


def llama_server_command(quant_type: str, parallel: int, plan: Plan) -> ServerCommand:
    command = server_command(quant_type, parallel, plan.prompt_len + plan.output_len + 64, plan.threads)
    if plan.llama_cache_type == "f16":
        return command
    cache = ("-ctk", plan.llama_cache_type, "-ctv", plan.llama_cache_type, "-fa", "on")
    return replace(command, argv=(*command.argv, *cache))


def hpi_server_command(weights: str, plan: Plan) -> ServerCommand:
    quant = () if weights == "unquantized" else ("--quantization", weights, "--quantize-lm-head",
                                                  "--int8-activations", plan.hpi_int8_activations)  # fmt: skip
    return hpi_command(plan.threads, "--dtype", plan.hpi_dtype, "--max-num-seqs", "64", "--kv-cache-dtype",
                       plan.hpi_kv_cache_dtype, *quant)  # fmt: skip


def _measure(server: ServerProcess, tokenizer, plan: Plan, concurrency: int, seed: int) -> dict:
    num_requests = max(4, concurrency * plan.requests_per_client)
    spec = WorkloadSpec(num_requests, LengthDist(plan.prompt_len), LengthDist(plan.output_len), seed=seed)
    warm = WorkloadSpec(2, LengthDist(plan.prompt_len), LengthDist(8), seed=seed + 1)
    for requests, clients in ((warm, 2), (spec, concurrency)):
        config = LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=clients)
        outcome = asyncio.run(run_load(build_requests(tokenizer, requests), config))
    return summarize(outcome)


def run(plan: Plan, log_dir: Path) -> dict:
    from transformers import AutoTokenizer

    from hpi_runtime.embedded import ensure_embedded_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    results: dict[str, list[dict]] = {}
    for round_index in range(plan.rounds):
        for weights, quant_type in PAIRS.items():
            if weights not in plan.weights:
                continue
            for concurrency in plan.concurrencies:
                seed = 1000 * round_index + concurrency  # new prompts per round: no prefix cache hits across runs
                llama = llama_server_command(quant_type, concurrency, plan)
                systems = [(f"hpi {weights}", hpi_server_command(weights, plan)), (f"llama.cpp {quant_type}", llama)]
                if round_index % 2:
                    systems.reverse()  # alternate which of the pair runs first
                for name, command in systems:
                    log = log_dir / f"{name.replace(' ', '_')}_{concurrency}_{round_index}.log"
                    try:
                        with ServerProcess(command, log) as server:
                            summary = _measure(server, tokenizer, plan, concurrency, seed)
                    except RuntimeError as e:  # a crash is a result too (llama.cpp segfaulted on AMX before)
                        summary = {"error": str(e)}
                    summary.update(round=round_index, concurrency=concurrency)
                    results.setdefault(name, []).append(summary)
                    tps = summary.get("output_tokens_per_s")
                    outcome = f"{tps:.1f} out tok/s" if tps else summary.get("error")
                    print(f"round {round_index} {name} N={concurrency}: {outcome}", flush=True)
    return results


def table(results: dict[str, list[dict]], plan: Plan) -> list[dict]:
    """Median output tok/s per system and concurrency over the rounds, and the ratios the issue's targets name."""
    def median(name: str, concurrency: int) -> float | None:
        values = [r["output_tokens_per_s"] for r in results.get(name, [])
                  if r["concurrency"] == concurrency and "output_tokens_per_s" in r]  # fmt: skip
        return statistics.median(values) if values else None

    rows = []
    for weights, quant_type in PAIRS.items():
        if weights not in plan.weights:
            continue
        for concurrency in plan.concurrencies:
            hpi, llama = median(f"hpi {weights}", concurrency), median(f"llama.cpp {quant_type}", concurrency)
            base = median("hpi unquantized", concurrency)
            rows.append({"weights": weights, "gguf": quant_type, "concurrency": concurrency, "hpi_tok_s": hpi,
                         "llama_tok_s": llama, "hpi_over_llama": hpi / llama if hpi and llama else None,
                         "hpi_over_unquantized": hpi / base if hpi and base else None})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=Plan.rounds)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(Plan.concurrencies))
    parser.add_argument("--output-len", type=int, default=Plan.output_len)
    parser.add_argument("--out", type=Path, default=RESULTS / "quant_llamacpp.json")
    parser.add_argument("--weights", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--hpi-dtype", default=Plan.hpi_dtype, help="hpi's --dtype (float32: an AVX2-only CPU's)")
    parser.add_argument("--hpi-kv-cache-dtype", default=Plan.hpi_kv_cache_dtype, help="hpi's --kv-cache-dtype")
    parser.add_argument("--hpi-int8-activations", default=Plan.hpi_int8_activations, choices=("auto", "int8", "float"),
                        help="hpi's --int8-activations for its quantized runs (int8: int4's q/k/v in W8A8 too)")
    parser.add_argument("--llama-cache-type", default=Plan.llama_cache_type, choices=("f16", "q8_0", "q4_0"),
                        help="llama-server's -ctk/-ctv (with its flash attention when quantized)")
    args = parser.parse_args()
    plan = Plan(concurrencies=tuple(args.concurrency), rounds=args.rounds, output_len=args.output_len,
                hpi_dtype=args.hpi_dtype,
                hpi_kv_cache_dtype=args.hpi_kv_cache_dtype, llama_cache_type=args.llama_cache_type,
                hpi_int8_activations=args.hpi_int8_activations, weights=tuple(args.weights))  # fmt: skip
    machine = machine_description()
    results = run(plan, RESULTS / "logs" / "quant_llamacpp")
    rows = table(results, plan)
    machine["load_average_at_end"] = list(os.getloadavg())
    machine["llama_cpp_build"] = build_variant()  # bench/llamacpp_build.py's BUILDS: "build", "build-avx2", ...
    args.out.write_text(json.dumps({"machine": machine, "plan": plan.__dict__, "quant_types": QUANT_TYPES,
                                    "table": rows, "runs": results}, indent=1, default=str) + "\n")  # fmt: skip
    print("| hpi weights | GGUF | clients | hpi tok/s | llama-server tok/s | hpi / llama.cpp | hpi / unquantized |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = [r["weights"], r["gguf"], r["concurrency"]] + [
            "-" if r[k] is None else f"{r[k]:.2f}" for k in ("hpi_tok_s", "llama_tok_s", "hpi_over_llama",
                                                            "hpi_over_unquantized")]  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
