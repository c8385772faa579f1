"""Decode attention over an fp8 KV cache against the model's dtype, in process: one layer of the embedded model's
attention (9 q heads, 3 kv heads, head_dim 64, block 16, scattered blocks), `requests` decode rows of `context`
keys each, through `hpi_kernels.paged_attention_cpu`. The two caches hold the same random values (the fp8 one
rounded); the calls alternate cache by cache in blocks so that the machine's drift weighs on both. Printed: median
microseconds a call for each cache and their ratio. With 2 requests the caches stay in L1/L2 (compute alone); with
32 they reach L3 or memory.

    .venv/bin/python -m bench.attention_fp8_cpu [--dtype float32|bfloat16] [--requests 2 32] [--cache fp8_e4m3]
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python -m bench.attention_fp8_cpu --dtype float32   # the AVX2 build
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hpi_kernels.cpu import cpu_capability, load_extension

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CACHES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def measure(dtype: torch.dtype, cache_dtype: torch.dtype, requests: int, context: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(requests)
    blocks_per_request = (context + BLOCK - 1) // BLOCK
    block_tables = torch.randperm(requests * blocks_per_request, generator=g).int().view(requests, -1)
    q = torch.randn(requests, HEADS, HEAD_DIM, generator=g).to(dtype)
    shape = (requests * blocks_per_request, BLOCK, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    caches = {"model": (k.to(dtype), v.to(dtype)), "fp8": (k.to(cache_dtype), v.to(cache_dtype))}
    query_start_loc = torch.arange(requests + 1, dtype=torch.int32)
    context_lens = torch.full((requests,), context, dtype=torch.int32)
    out = torch.empty_like(q)

    def call(k_cache, v_cache) -> None:
        torch.ops.hpi_kernels.paged_attention_cpu(out, q, k_cache, v_cache, block_tables, query_start_loc,
                                                  context_lens, HEAD_DIM**-0.5, 0, 0.0)  # fmt: skip

    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(rounds):
        for name, (k_cache, v_cache) in caches.items():
            for _ in range(10):
                call(k_cache, v_cache)
            for _ in range(100):
                start = time.perf_counter()
                call(k_cache, v_cache)
                times[name].append(time.perf_counter() - start)
    us = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    return {"model_us": us["model"], "fp8_us": us["fp8"], "fp8_over_model": us["fp8"] / us["model"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--cache", default="fp8_e4m3", choices=list(CACHES))
    parser.add_argument("--requests", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    load_extension()
    for name in args.dtype:
        for requests in args.requests:
            row = measure(getattr(torch, name), CACHES[args.cache], requests, args.context, args.rounds)
            row = {"build": cpu_capability(), "dtype": name, "cache": args.cache, "requests": requests, **row}
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
