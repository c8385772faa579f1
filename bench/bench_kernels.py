"""GPU benchmark for hpi_kernels: paged attention bandwidth and weight-only matmul speed.

    python bench/bench_kernels.py [--peak-gbps 4800] [--quick]

Prints, per shape: kernel time, achieved memory bandwidth (decode attention) as a fraction of the GPU's
peak, and ratios against torch baselines (SDPA on dense K/V; bf16 matmul; dequantize-then-matmul).
Goals (issue 6): decode attention > 70% of peak bandwidth at long contexts; INT4 decode matmul faster
than bf16. Needs CUDA; not a test.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

# Peak HBM bandwidth by device-name substring, GB/s (vendor figures).
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0, "4090": 1008.0}


def _peak_gbps(override: float | None) -> float:
    if override:
        return override
    name = torch.cuda.get_device_name()
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps
    sys.exit(f"unknown GPU {name!r}: pass --peak-gbps")


def _bench_ms(fn, *args, **kwargs) -> float:
    """Median milliseconds of fn(*args, **kwargs) (triton's do_bench: warm-up, L2 flush between runs)."""
    from triton.testing import do_bench

    return do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median")


def bench_decode(peak_gbps: float, quick: bool) -> None:
    from hpi_kernels import paged_decode_attention
    from hpi_kernels.paged_attention import choose_num_splits

    num_sms = torch.cuda.get_device_properties().multi_processor_count
    num_q_heads, num_kv_heads, head_dim, block_size, dtype = 32, 8, 128, 16, torch.bfloat16
    batches = [1, 8, 64] if quick else [1, 8, 32, 64, 128, 256]
    contexts = [1024, 8192] if quick else [1024, 4096, 16384, 32768]
    print(f"\n# paged decode attention: Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} bf16 block={block_size}")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'us':>9} {'GB/s':>8} {'%peak':>6} {'SDPA us':>9} {'vs SDPA':>8}")
    for batch in batches:
        for context in contexts:
            num_tokens = batch * context
            if num_tokens > 4 * 2**20:  # > 16 GiB of K/V: skip rather than alias blocks (L2 would flatter us)
                continue
            blocks_per_seq = context // block_size
            num_blocks = batch * blocks_per_seq
            cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
            k_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
            v_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
            block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
            context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            query = torch.randn(batch, num_q_heads, head_dim, device="cuda", dtype=dtype)
            scale = head_dim**-0.5
            splits = choose_num_splits(batch * num_kv_heads, blocks_per_seq * block_size, num_sms)
            ms = _bench_ms(paged_decode_attention, query, k_cache, v_cache, block_tables, context_lens, scale)
            bytes_moved = 2 * num_tokens * num_kv_heads * head_dim * dtype.itemsize
            gbps = bytes_moved / ms / 1e6
            # Baseline: SDPA over dense, contiguous K/V (no paging) of the same size.
            k_dense = k_cache.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)
            v_dense = v_cache.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)
            q_dense = query.unsqueeze(2)
            sdpa_ms = _bench_ms(F.scaled_dot_product_attention, q_dense, k_dense, v_dense, enable_gqa=True)
            print(
                f"{batch:>6} {context:>8} {splits:>6} {ms * 1e3:>9.1f} {gbps:>8.0f} {gbps / peak_gbps:>6.0%} "
                f"{sdpa_ms * 1e3:>9.1f} {sdpa_ms / ms:>7.2f}x"
            )
            k_cache = v_cache = k_dense = v_dense = None
            torch.cuda.empty_cache()


def bench_prefill(quick: bool) -> None:
    from hpi_kernels import paged_prefill_attention

    num_q_heads, num_kv_heads, head_dim, block_size, dtype = 32, 8, 128, 16, torch.bfloat16
    print("\n# paged prefill attention (one new prompt, causal) vs SDPA causal on dense K/V")
    print(f"{'tokens':>7} {'us':>10} {'TFLOP/s':>8} {'SDPA us':>10} {'vs SDPA':>8}")
    for tokens in [512, 2048] if quick else [512, 2048, 8192]:
        num_blocks = tokens // block_size
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
        v_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
        block_tables = torch.arange(num_blocks, device="cuda", dtype=torch.int32).view(1, -1)
        query = torch.randn(tokens, num_q_heads, head_dim, device="cuda", dtype=dtype)
        query_start_loc = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
        context_lens = torch.tensor([tokens], device="cuda", dtype=torch.int32)
        args = (query, k_cache, v_cache, block_tables, query_start_loc, context_lens, head_dim**-0.5)
        ms = _bench_ms(paged_prefill_attention, *args, max_query_len=tokens)
        flops = 2 * 2 * num_q_heads * head_dim * tokens * tokens / 2  # causal: half of QK^T and PV
        q_dense = query.transpose(0, 1).unsqueeze(0)
        k_dense = k_cache.view(tokens, num_kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
        v_dense = v_cache.view(tokens, num_kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
        sdpa_ms = _bench_ms(F.scaled_dot_product_attention, q_dense, k_dense, v_dense, is_causal=True, enable_gqa=True)
        print(f"{tokens:>7} {ms * 1e3:>10.1f} {flops / ms / 1e9:>8.1f} {sdpa_ms * 1e3:>10.1f} {sdpa_ms / ms:>7.2f}x")


def _dequantize_matmul(x: torch.Tensor, dequantize, *quantized) -> torch.Tensor:
    """The baseline a fused kernel must beat: materialise the weight in x's dtype, then matmul."""
    return x @ dequantize(*quantized).to(x.dtype).T


def bench_matmul(quick: bool) -> None:
    from hpi_kernels import int4_weight_only_matmul, int8_weight_only_matmul
    from hpi_kernels.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

    dtype, group_size = torch.bfloat16, 128
    print(f"\n# weight-only matmul vs torch bf16 matmul (x @ W.T) and dequantize+matmul; int4 group {group_size}")
    print(
        f"{'M':>5} {'N':>6} {'K':>6} {'bf16 us':>9} {'int8 us':>9} {'int8 vs bf16':>12} {'int8 vs dq+mm':>13} "
        f"{'int4 us':>9} {'int4 vs bf16':>12} {'int4 vs dq+mm':>13}"
    )
    shapes = [(4096, 4096), (11008, 4096)] if quick else [(4096, 4096), (11008, 4096), (4096, 11008), (128256, 4096)]
    for n, k in shapes:
        weight = torch.randn(n, k, device="cuda", dtype=dtype)
        q8, s8 = quantize_int8(weight)
        p4, s4, z4 = quantize_int4(weight, group_size)
        for m in [1, 16, 64, 512] if quick else [1, 4, 16, 32, 64, 128, 256, 512]:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            bf16_ms = _bench_ms(torch.matmul, x, weight.T)
            int8_ms = _bench_ms(int8_weight_only_matmul, x, q8, s8)
            int8_dq_ms = _bench_ms(_dequantize_matmul, x, dequantize_int8, q8, s8)
            int4_ms = _bench_ms(int4_weight_only_matmul, x, p4, s4, z4, group_size)
            int4_dq_ms = _bench_ms(_dequantize_matmul, x, dequantize_int4, p4, s4, z4, group_size)
            print(
                f"{m:>5} {n:>6} {k:>6} {bf16_ms * 1e3:>9.1f} {int8_ms * 1e3:>9.1f} {bf16_ms / int8_ms:>11.2f}x "
                f"{int8_dq_ms / int8_ms:>12.2f}x {int4_ms * 1e3:>9.1f} {bf16_ms / int4_ms:>11.2f}x "
                f"{int4_dq_ms / int4_ms:>12.2f}x"
            )
        weight = q8 = p4 = None
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-gbps", type=float, default=None, help="peak HBM bandwidth; default by GPU name")
    parser.add_argument("--quick", action="store_true", help="a few shapes only (~1 minute)")
    parser.add_argument("--only", choices=["decode", "prefill", "matmul"], default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.only in (None, "decode"):
        bench_decode(_peak_gbps(args.peak_gbps), args.quick)
    if args.only in (None, "prefill"):
        bench_prefill(args.quick)
    if args.only in (None, "matmul"):
        bench_matmul(args.quick)


if __name__ == "__main__":
    main()
