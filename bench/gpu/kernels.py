"""GPU check, part `kernels`: the Triton kernels against torch, in the 1B shape (32 query / 8 KV heads of 64, bf16).

- Paged decode attention at batch 32 over 512 to 32k tokens of context, against the plain-PyTorch reference
  (hpi_kernels/reference.py: obvious, fp32, one request at a time) and SDPA on the same K/V viewed dense (no
  paging: what a kernel at the memory bound approaches); achieved K/V read bandwidth; max abs error vs the reference.
- Paged prefill attention of one causal prompt of 512 to 8k tokens, against the same two.
- Weight-only int8 (per channel) and int4 (group-wise) matmul against bf16 `torch.matmul` (cuBLAS) on the 1B
  model's fused GEMMs (qkv, o, gate_up, down) at M = 1, 16, 128 and 1024 rows; max error vs the dequantized
  reference. These are timed in a CUDA graph with a weight copy per call (bench/bench_quant_matmul_gpu.py's
  graph_ms): GPU time, no weight read from the L2; launched one by one they measured the Python launcher.

Attention times are CUDA-event means (part.time_ms) after warm-up, so each kernel's first-call JIT compile stays out
of them (but inside the part's budget). Dry run (CPU): toy sizes in fp32; the references and SDPA run (shapes and launch
arguments checked), the Triton kernels only when TRITON_INTERPRET=1 (as the test suite sets it), for their error
alone; every Triton timing is listed as skipped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from bench.bench_quant_matmul_gpu import graph_ms as rotated_graph_ms
from bench.bench_quant_matmul_gpu import l2_missing_copies
from bench.gpu.part import PartContext, time_ms
from bench.gpu.shared import PAST_DEADLINE, failure_note, failure_record
from bench.gpu.weights import ONE_B_SHAPE
from hpi_runtime.quantization.quantize import DEFAULT_INT4_GROUP_SIZE

NEEDS_CUDA = "Triton kernel timings need CUDA (a dry run times nothing of Triton's)"
NO_INTERPRETER = "the Triton kernels need CUDA, or TRITON_INTERPRET=1 on CPU (not set here)"


def one_b_gemms() -> tuple[tuple[str, int, int], ...]:
    """The 1B model's linears as the runtime fuses them (models/decoder.py: qkv_proj, gate_up_proj)."""
    s = ONE_B_SHAPE
    hidden, mlp = s["hidden_size"], s["intermediate_size"]
    qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * s["head_dim"]
    return (("qkv", qkv, hidden), ("o", hidden, s["num_attention_heads"] * s["head_dim"]),
            ("gate_up", 2 * mlp, hidden), ("down", hidden, mlp))  # fmt: skip


@dataclass(frozen=True)
class KernelPlan:
    """What the part measures; the defaults are the GPU plan, a dry run replaces the sizes."""

    decode_batch: int = 32
    decode_contexts: tuple[int, ...] = (512, 2048, 8192, 32768)
    prefill_tokens: tuple[int, ...] = (512, 2048, 8192)
    gemms: tuple[tuple[str, int, int], ...] = one_b_gemms()  # (layer, N, K): y[M, N] = x[M, K] @ W[N, K].T
    matmul_rows: tuple[int, ...] = (1, 16, 128, 1024)  # M
    num_q_heads: int = ONE_B_SHAPE["num_attention_heads"]
    num_kv_heads: int = ONE_B_SHAPE["num_key_value_heads"]
    head_dim: int = ONE_B_SHAPE["head_dim"]
    block_size: int = 16
    group_size: int = DEFAULT_INT4_GROUP_SIZE  # int4 weights per (scale, zero) along K, as the runtime quantizes
    dtype: torch.dtype = torch.bfloat16
    iters: int = 20
    ref_iters: int = 3  # the references are slow: fewer timed calls
    time_triton: bool = True  # on CUDA
    run_triton: bool = True  # on CUDA, or interpreted on CPU


def plan_for(ctx: PartContext) -> KernelPlan:
    if not ctx.dry_run:
        return KernelPlan()
    return replace(
        KernelPlan(), decode_batch=2, decode_contexts=(32, 80), prefill_tokens=(32,), gemms=(("toy", 64, 128),),
        matmul_rows=(1, 16), dtype=torch.float32, iters=2, ref_iters=1, time_triton=False,
        run_triton=os.environ.get("TRITON_INTERPRET") == "1",
    )  # fmt: skip


def max_abs_error(
    a: torch.Tensor,  # any shape
    b: torch.Tensor,  # a's shape
) -> float:
    return (a.float() - b.float()).abs().max().item()


def _timed(device: torch.device, fn: Callable[[], object], iters: int) -> float:
    """Mean ms of `fn`: fewer warm-up calls for the slow references (few iterations)."""
    return time_ms(fn, device, iters, warmup=1 if iters < 5 else 3)


def paged_cache(plan: KernelPlan, batch: int, context: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """K and V caches [batch * context / block_size, block_size, Hkv, D] of random values, block tables [batch,
    blocks] int32 in a random order (as a running server's are), context lengths [batch] int32."""
    blocks_per_seq = -(-context // plan.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, plan.block_size, plan.num_kv_heads, plan.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=plan.dtype)
    v_cache = torch.randn(shape, device=device, dtype=plan.dtype)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, context_lens


def decode_attention(plan: KernelPlan, context: int, device: torch.device) -> dict:
    from hpi_kernels.reference import paged_decode_attention_ref

    batch = plan.decode_batch
    k_cache, v_cache, block_tables, context_lens = paged_cache(plan, batch, context, device)
    query = torch.randn(batch, plan.num_q_heads, plan.head_dim, device=device, dtype=plan.dtype)
    args = (query, k_cache, v_cache, block_tables, context_lens, plan.head_dim**-0.5)
    expected = paged_decode_attention_ref(*args)
    assert expected.shape == query.shape
    # The same bytes viewed as dense [B, Hkv, S, D] (context is a whole number of blocks in the plan).
    k_dense = k_cache.view(batch, context, plan.num_kv_heads, plan.head_dim).transpose(1, 2)
    v_dense = v_cache.view(batch, context, plan.num_kv_heads, plan.head_dim).transpose(1, 2)
    result = {
        "reference_ms": _timed(device, lambda: paged_decode_attention_ref(*args), plan.ref_iters),
        "sdpa_dense_ms": _timed(device, lambda: F.scaled_dot_product_attention(
            query.unsqueeze(2), k_dense, v_dense, enable_gqa=True), plan.iters),  # fmt: skip
    }
    result.update(_run_triton(plan, device, "paged_decode_attention", args, {}, expected))
    if "triton_ms" in result:
        kv_bytes = 2 * batch * context * plan.num_kv_heads * plan.head_dim * plan.dtype.itemsize
        result["triton_kv_read_gb_s"] = kv_bytes / result["triton_ms"] / 1e6
        result["speedup_vs_reference"] = result["reference_ms"] / result["triton_ms"]
        result["speedup_vs_sdpa_dense"] = result["sdpa_dense_ms"] / result["triton_ms"]
    return result


def prefill_attention(plan: KernelPlan, tokens: int, device: torch.device) -> dict:
    from hpi_kernels.reference import paged_prefill_attention_ref

    k_cache, v_cache, block_tables, context_lens = paged_cache(plan, 1, tokens, device)
    query = torch.randn(tokens, plan.num_q_heads, plan.head_dim, device=device, dtype=plan.dtype)
    query_start_loc = torch.tensor([0, tokens], device=device, dtype=torch.int32)
    args = (query, k_cache, v_cache, block_tables, query_start_loc, context_lens, plan.head_dim**-0.5)
    expected = paged_prefill_attention_ref(*args)
    assert expected.shape == query.shape
    order = block_tables[0].long()  # the prompt's blocks in order, gathered once for the dense baseline
    k_dense = k_cache[order].view(tokens, plan.num_kv_heads, plan.head_dim).transpose(0, 1).unsqueeze(0)
    v_dense = v_cache[order].view(tokens, plan.num_kv_heads, plan.head_dim).transpose(0, 1).unsqueeze(0)
    q_dense = query.transpose(0, 1).unsqueeze(0)
    result = {
        "reference_ms": _timed(device, lambda: paged_prefill_attention_ref(*args), plan.ref_iters),
        "sdpa_dense_ms": _timed(device, lambda: F.scaled_dot_product_attention(
            q_dense, k_dense, v_dense, is_causal=True, enable_gqa=True), plan.iters),  # fmt: skip
    }
    result.update(_run_triton(plan, device, "paged_prefill_attention", args, {"max_query_len": tokens}, expected))
    if "triton_ms" in result:
        flops = 2 * 2 * plan.num_q_heads * plan.head_dim * tokens * tokens / 2  # causal: half of QK^T and PV
        result["triton_tflop_s"] = flops / result["triton_ms"] / 1e9
        result["speedup_vs_reference"] = result["reference_ms"] / result["triton_ms"]
        result["speedup_vs_sdpa_dense"] = result["sdpa_dense_ms"] / result["triton_ms"]
    return result


def _run_triton(
    plan: KernelPlan, device: torch.device, name: str, args: tuple, kwargs: dict, expected: torch.Tensor
) -> dict:
    """The kernel's error against `expected` where it can run here, and its time where that means something."""
    if not plan.run_triton:
        return {}
    import hpi_kernels

    kernel = getattr(hpi_kernels, name)
    out = kernel(*args, **kwargs)
    result = {"max_abs_err": max_abs_error(out, expected)}
    if plan.time_triton:
        result["triton_ms"] = _timed(device, lambda: kernel(*args, **kwargs), plan.iters)
    return result


def quant_matmul(plan: KernelPlan, n: int, k: int, device: torch.device, deadline: float) -> dict:
    """Per M: torch.matmul ms (cuBLAS, bf16 on the GPU), the int8 and int4 kernels' ms, speed-ups and errors vs the
    dequantized references ("rows", by M), and the Ms the deadline cut ("rows_cut")."""
    import hpi_kernels
    from hpi_kernels.quant import quantize_int4, quantize_int8
    from hpi_kernels.reference import int4_weight_only_matmul_ref, int8_weight_only_matmul_ref

    weight = torch.randn(n, k, device=device, dtype=plan.dtype) * k**-0.5
    q8, s8 = quantize_int8(weight)
    p4, s4, z4 = quantize_int4(weight, plan.group_size)
    # Timed on CUDA in a graph, each call on the next copy of its weight (as a model's layers are) so none is read
    # from the L2: GPU time, as a decode step under CUDA graphs pays it. A dry run times nothing of Triton's.
    copies = {}
    if plan.time_triton:
        copies = {"bf16": [(weight.clone(),) for _ in range(l2_missing_copies(weight.numel() * weight.element_size()))],
                  "int8": [(q8.clone(), s8) for _ in range(l2_missing_copies(q8.numel()))],
                  "int4": [(p4.clone(), s4, z4) for _ in range(l2_missing_copies(p4.numel()))]}  # fmt: skip
    kernels = {"int8": lambda x, w: hpi_kernels.int8_weight_only_matmul(x, *w),
               "int4": lambda x, w: hpi_kernels.int4_weight_only_matmul(x, *w, plan.group_size)}  # fmt: skip
    rows, cut = {}, []
    for m in plan.matmul_rows:
        if time.perf_counter() > deadline:
            cut.append(m)
            continue
        x = torch.randn(m, k, device=device, dtype=plan.dtype)
        row = {}
        if plan.time_triton:
            bf16_calls = [(x, *w) for w in copies["bf16"]]
            row["torch_matmul_ms"] = rotated_graph_ms(lambda x, w: torch.matmul(x, w.T), bf16_calls)
        else:  # a dry run: the CPU's matmul, launch by launch
            row["torch_matmul_ms"] = _timed(device, lambda x=x: torch.matmul(x, weight.T), plan.iters)
        variants = {"int8": ("int8_weight_only_matmul", (x, q8, s8), int8_weight_only_matmul_ref(x, q8, s8)),
                    "int4": ("int4_weight_only_matmul", (x, p4, s4, z4, plan.group_size),
                             int4_weight_only_matmul_ref(x, p4, s4, z4, plan.group_size))}  # fmt: skip
        for label, (name, args, expected) in variants.items():
            assert expected.shape == (m, n)
            measured = _run_triton(replace(plan, time_triton=False), device, name, args, {}, expected)
            if plan.time_triton:
                measured["triton_ms"] = rotated_graph_ms(kernels[label], [(x, w) for w in copies[label]])
            scale = expected.float().abs().max().item() or 1.0
            row.update({f"{label}_{key}": value for key, value in measured.items()})
            if "max_abs_err" in measured:
                row[f"{label}_rel_err"] = measured["max_abs_err"] / scale
            if "triton_ms" in measured:
                row[f"{label}_speedup_vs_torch"] = row["torch_matmul_ms"] / measured["triton_ms"]
        rows[str(m)] = row
    return {"n": n, "k": k, "rows": rows, "rows_cut": cut}


def run(ctx: PartContext) -> dict:
    deadline = ctx.deadline()
    plan = plan_for(ctx)
    device = ctx.device
    skipped: dict[str, str] = {}
    if not plan.time_triton:
        skipped["triton timings"] = NEEDS_CUDA
    if not plan.run_triton:
        skipped["triton errors"] = NO_INTERPRETER
    results: dict = {
        "shape": {"num_q_heads": plan.num_q_heads, "num_kv_heads": plan.num_kv_heads, "head_dim": plan.head_dim,
                  "block_size": plan.block_size, "dtype": str(plan.dtype).removeprefix("torch."),
                  "int4_group_size": plan.group_size},  # fmt: skip
        "decode_batch": plan.decode_batch,
        "decode": {}, "prefill": {}, "matmul": {},  # fmt: skip
    }
    # (group, key, what `skipped` calls it, the measurement), in the order they run until the deadline.
    jobs = [("decode", str(c), f"decode context {c}", partial(decode_attention, plan, c, device))
            for c in plan.decode_contexts]
    jobs += [("prefill", str(t), f"prefill {t} tokens", partial(prefill_attention, plan, t, device))
             for t in plan.prefill_tokens]
    jobs += [("matmul", layer, f"matmul {layer}", partial(quant_matmul, plan, n, k, device, deadline))
             for layer, n, k in plan.gemms]  # fmt: skip
    errors = []
    for group, key, what, measure in jobs:
        if time.perf_counter() > deadline:
            skipped[what] = PAST_DEADLINE
            continue
        try:
            results[group][key] = measure()
        except Exception as exc:  # one size failing (an index overflow, an OOM) keeps the other sizes' numbers
            errors.append(exc)
            results[group][key], skipped[what] = failure_record(exc), failure_note(exc)
        skipped.update({f"{what} M={m}": PAST_DEADLINE for m in results[group][key].pop("rows_cut", ())})
        _release(device)
    if errors and len(errors) == sum(len(results[group]) for group in ("decode", "prefill", "matmul")):
        raise errors[0]  # nothing measured: the part failed, with the first error's traceback
    results["headline"] = headline(results)
    results["skipped"] = skipped
    return results


def headline(results: dict) -> list[str]:
    """Triton's speed-up over the torch reference per size (and its error), and the quantized matmuls' over bf16."""
    lines = []
    for group in ("decode", "prefill"):
        cells = [f"{key} {r['speedup_vs_reference']:.1f}x (err {r['max_abs_err']:.1e})"
                 for key, r in results[group].items() if "speedup_vs_reference" in r]  # fmt: skip
        if cells:
            lines.append(f"{group} attention, Triton over the reference: " + ", ".join(cells))
    for layer, r in results["matmul"].items():
        cells = [f"M={m} int8 {row['int8_speedup_vs_torch']:.2f}x int4 {row['int4_speedup_vs_torch']:.2f}x"
                 for m, row in r.get("rows", {}).items() if "int4_speedup_vs_torch" in row]  # fmt: skip
        if cells:
            lines.append(f"matmul {layer} ({r['n']}x{r['k']}) over bf16 torch.matmul: " + ", ".join(cells))
    return lines


def _release(device: torch.device) -> None:
    if device.type == "cuda":  # the next size's caches need the memory this one's held
        torch.cuda.empty_cache()
