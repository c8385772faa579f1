"""Decode attention over a `--kv-cache-dtype` cache (fp8, or bf16 under an fp32 model) against the model's dtype, in
process: one layer of the embedded model's attention (9 q heads, 3 kv heads, head_dim 64, block 16, scattered
blocks), `requests` decode rows of `context` keys each, through `hpi_kernels.paged_attention_cpu`. The two caches
hold the same random values (the narrower one rounded); the calls alternate cache by cache in blocks so that the
machine's drift weighs on both. Printed: median microseconds a call (a layer) for each cache and their ratio. With 2
requests the caches stay in L1/L2 (compute alone); with 32, one layer's stays in L3, and `--layers 30` (the embedded
model's count, called in turn as a decode step does) puts the step's caches past L3, in memory, as when serving.

    .venv/bin/python -m bench.attention_kv_dtype_cpu [--dtype float32 bfloat16] [--requests 2 32] [--cache fp8_e4m3]
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python -m bench.attention_kv_dtype_cpu --dtype float32 --cache bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hpi_kernels.cpu import cpu_capability, load_extension

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CACHES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "bfloat16": torch.bfloat16}


def measure(dtype: torch.dtype, cache_dtype: torch.dtype, requests: int, context: int, rounds: int,
            layers: int = 1) -> dict:  # fmt: skip
    g = torch.Generator().manual_seed(requests)
    blocks_per_request = (context + BLOCK - 1) // BLOCK
    block_tables = torch.randperm(requests * blocks_per_request, generator=g).int().view(requests, -1)
    q = torch.randn(requests, HEADS, HEAD_DIM, generator=g).to(dtype)
    shape = (requests * blocks_per_request, BLOCK, KV_HEADS, HEAD_DIM)
    kv = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(layers)]
    caches = {"model": [(k.to(dtype), v.to(dtype)) for k, v in kv],
              "cache": [(k.to(cache_dtype), v.to(cache_dtype)) for k, v in kv]}  # fmt: skip
    query_start_loc = torch.arange(requests + 1, dtype=torch.int32)
    context_lens = torch.full((requests,), context, dtype=torch.int32)
    out = torch.empty_like(q)

    def step(layer_caches) -> None:  # every layer once, in turn
        for k_cache, v_cache in layer_caches:
            torch.ops.hpi_kernels.paged_attention_cpu(out, q, k_cache, v_cache, block_tables, query_start_loc,
                                                      context_lens, HEAD_DIM**-0.5, 0, 0.0)  # fmt: skip

    times: dict[str, list[float]] = {name: [] for name in caches}
    calls = max(1, 100 // layers)
    for _ in range(rounds):
        for name, layer_caches in caches.items():
            step(layer_caches)
            for _ in range(calls):
                start = time.perf_counter()
                step(layer_caches)
                times[name].append((time.perf_counter() - start) / layers)
    us = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    return {"model_us": us["model"], "cache_us": us["cache"], "cache_over_model": us["cache"] / us["model"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--cache", default="fp8_e4m3", choices=list(CACHES))
    parser.add_argument("--requests", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=1, help="caches called in turn (30: past L3, as when serving)")
    args = parser.parse_args()
    load_extension()
    for name in args.dtype:
        for requests in args.requests:
            row = measure(getattr(torch, name), CACHES[args.cache], requests, args.context, args.rounds, args.layers)
            row = {"build": cpu_capability(), "dtype": name, "cache": args.cache, "requests": requests,
                   "layers": args.layers, **row}  # fmt: skip
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
