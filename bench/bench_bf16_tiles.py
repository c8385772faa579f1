"""The packed bf16 linear's tiles against torch's own bf16 GEMM, on the machine it runs on: the kernels alone, then
the engine.

Kernels: the linears of the embedded model's decoder layers (SmolLM2-135M, the shapes of bench_quant_linear.py;
--layers layers of distinct weights, which together do not fit the caches) at each row count, per path, timed in
alternation in one process (best of --rounds): `F.linear` over the weight as a model stores it ([out, in]: torch's
bf16 GEMM, oneDNN, AMX tiles where the CPU has them), `torch.mm` over it pre-transposed ([in, out]), and
hpi_kernels' packed linear with each tile this CPU has (`bf16_tile`: widen, dpbf16, amx).

Engine: the offline engine (prefix caching off) in a closed loop of --concurrency requests in flight, each 64
prompt + 32 output tokens, a new one added as one finishes, --num-requests in all; one child process per variant,
the variants alternating over --engine-rounds, on CPUs with AMX only: "torch" (HPI_CPU_BF16_TILE=widen: bf16
weights stay as loaded, for torch's GEMMs, as before the AMX tile) against "amx". Prints output tok/s, the median
decode step (ms) at each batch size and the median prefill step, and the ratios against "torch".

    .venv/bin/python -m bench.bench_bf16_tiles --json bench/results/amx.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
TILES = ("widen", "dpbf16", "amx")


def available_tiles() -> list[str]:
    from hpi_kernels.cpu import bf16_tile

    previous, found = bf16_tile(), []
    for tile in TILES:
        try:
            bf16_tile(tile)
            found.append(tile)
        except ValueError:
            pass
    bf16_tile(previous)
    return found


def kernels(rows_list: list[int], layers: int, rounds: int) -> dict:
    import torch
    import torch.nn.functional as F

    from hpi_kernels.cpu import bf16_tile, pack_linear_weight, packed_linear

    weights = [(n, torch.randn(n, k).bfloat16()) for _ in range(layers) for n, k in SHAPES.values()]
    transposed = [w.t().contiguous() for _, w in weights]
    packed = [pack_linear_weight(w) for _, w in weights]
    tiles, previous = available_tiles(), bf16_tile()
    out: dict = {}
    for rows in rows_list:
        xs = [torch.randn(rows, w.shape[1]).bfloat16() for _, w in weights]
        calls = {  # name -> (the tile to set first, or None; one pass over the layers)
            "torch F.linear": (None, lambda xs=xs: [F.linear(x, w) for x, (_, w) in zip(xs, weights, strict=True)]),
            "torch mm [in, out]": (None, lambda xs=xs: [torch.mm(x, wt) for x, wt in zip(xs, transposed, strict=True)]),
        }
        for tile in tiles:
            calls[f"packed {tile}"] = (tile, lambda xs=xs: [
                packed_linear(x, p, n) for x, p, (n, _) in zip(xs, packed, weights, strict=True)])  # fmt: skip
        best = {name: float("inf") for name in calls}
        for _ in range(rounds):
            for name, (tile, call) in calls.items():
                if tile is not None:
                    bf16_tile(tile)
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
        base = best["torch F.linear"]
        out[rows] = {name: {"ms": 1000 * t, "x_torch": t / base} for name, t in best.items()}
        print(f"rows {rows:5d}: " + ", ".join(f"{n} {1000 * t:.2f} ms ({t / base:.2f}x)" for n, t in best.items()),
              flush=True)  # fmt: skip
    bf16_tile(previous)
    return out


def engine_child(concurrency: int, num_requests: int) -> dict:
    """In a child process: the closed loop; prints one JSON line."""
    from transformers import AutoTokenizer

    from bench.loadgen import LengthDist, WorkloadSpec, build_requests
    from hpi_kernels.cpu import bf16_tile
    from hpi_runtime.embedded import ensure_embedded_model
    from hpi_runtime.llm import LLM
    from hpi_runtime.sampling_params import SamplingParams

    base = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(base)
    requests = build_requests(tokenizer, WorkloadSpec(num_requests, LengthDist(64), LengthDist(32), seed=0))
    prompts = [tokenizer(r.prompt)["input_ids"] for r in requests]
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)
    engine = LLM(str(base), max_num_seqs=concurrency, kv_cache_memory_bytes=512 << 20,
                 enable_prefix_caching=False).engine  # fmt: skip
    scheduler = engine.core.scheduler

    def loop(prompts: list[list[int]]) -> tuple[float, dict[str, list[float]]]:
        steps: dict[str, list[float]] = {}
        queue, tokens = list(prompts), 0
        for _ in range(min(concurrency, len(queue))):
            engine.add_request(f"r{len(queue)}-{time.monotonic_ns()}", queue.pop(), params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            kind = "prefill" if scheduler.waiting else f"decode{len(scheduler.running)}"
            step_start = time.perf_counter()
            outputs = engine.step()
            steps.setdefault(kind, []).append(time.perf_counter() - step_start)
            for output in outputs:
                if output.finished:
                    tokens += len(output.output_token_ids)
                    if queue:
                        engine.add_request(f"r{len(queue)}-{time.monotonic_ns()}", queue.pop(), params)
        return tokens / (time.perf_counter() - start), steps

    loop(prompts[: concurrency // 2 or 1])  # warm-up: compiled graphs, the kernels' first calls
    tok_s, steps = loop(prompts)
    return {"tile": bf16_tile(), "output_tok_s": tok_s,
            "step_ms_median": {k: 1000 * statistics.median(v) for k, v in steps.items() if len(v) >= 3}}  # fmt: skip


def engine(variants: list[str], concurrency_list: list[int], num_requests: int, rounds: int) -> dict:
    out: dict = {}
    for round_index in range(rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for concurrency in concurrency_list:
            for variant in order:
                env = {**os.environ, "HPI_CPU_BF16_TILE": "widen" if variant == "torch" else variant}
                child = subprocess.run([sys.executable, "-m", "bench.bench_bf16_tiles", "--child", str(concurrency),
                                        "--num-requests", str(num_requests)], env=env, capture_output=True, text=True,
                                       check=True)  # fmt: skip
                result = json.loads(child.stdout.strip().splitlines()[-1])
                out.setdefault(f"{variant}@{concurrency}", []).append(result)
                decode = {k: round(v, 1) for k, v in result["step_ms_median"].items()}
                print(f"round {round_index + 1}, {concurrency} in flight, {variant} (tile {result['tile']}): "
                      f"{result['output_tok_s']:.1f} tok/s, median step ms {decode}", flush=True)  # fmt: skip
    for concurrency in concurrency_list:
        base = [r["output_tok_s"] for r in out[f"torch@{concurrency}"]]
        for variant in variants[1:]:
            ratios = [r["output_tok_s"] / b for r, b in zip(out[f"{variant}@{concurrency}"], base, strict=True)]
            print(f"{concurrency} in flight: {variant} / torch per round {[round(x, 2) for x in ratios]}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 320, 512, 2048])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--num-requests", type=int, default=160)
    parser.add_argument("--engine-rounds", type=int, default=2)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("HPI_BENCH_THREADS", "2")))
    if args.child is not None:
        print(json.dumps(engine_child(args.child, args.num_requests)))
        return
    from hpi_runtime import cpu_features

    machine = {"cpu": platform.processor() or platform.machine(), "amx": cpu_features.has_amx(),
               "avx512_bf16": cpu_features.has_fast_bf16(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "tiles": available_tiles()}  # fmt: skip
    print("machine:", machine, flush=True)
    results: dict = {"machine": machine, "kernels": kernels(args.rows, args.layers, args.rounds)}
    if not args.skip_engine and "amx" in machine["tiles"]:
        results["engine"] = engine(["torch", "amx"], args.concurrency, args.num_requests, args.engine_rounds)
    elif not args.skip_engine:  # without AMX, bf16 weights are packed whatever the tile: no torch variant to run
        print("engine: the torch / packed comparison needs a CPU with AMX; bench_model_runner compares the tiles")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
