"""The compute roofline: this machine's measured matmul peak and the model's FLOPs per token; and the
batch-1 floor: the time one decode step needs just to stream every weight matrix through the CPU once.

Peak is the best GFLOP/s reached on the model's own GEMM shapes (M tokens x hidden -> intermediate and
back) at M = 64..256, per dtype, by torch's matmul or by hpi_kernels' packed linear where the C++ kernels
build (on AVX512-BF16 without AMX, torch's bf16 GEMM reaches half of fp32's rate and the packed bf16 kernel
fp32's: the better of the two is what this machine can do in that dtype). Measured in the same run as the
serving numbers (the machine is shared and clocks vary, so a datasheet figure would flatter or blame the
wrong thing).

A single request's decode multiplies one row through every weight: memory-bound, so its floor is the
model's own linears (each layer's weights as separate tensors, as in the model, so caches do not help) at
M = 1, timed as one pass, best of several, by the better of the same two GEMMs. No engine can decode one
stream faster than that.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def model_flops_per_token(model_dir: Path) -> dict:
    """2 x the weights every token multiplies through (all linears and the LM head), and the attention
    FLOPs per token per token of context."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q_dim, kv_dim = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    per_layer = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden + 3 * hidden * c["intermediate_size"]
    linear_params = layers * per_layer + hidden * c["vocab_size"]
    return {
        "linear_flops_per_token": 2 * linear_params,
        "attention_flops_per_token_per_context_token": 4 * layers * q_dim,  # QK^T and PV
    }


def _packed_kernels() -> bool:
    from hpi_kernels.cpu import cpu_kernels_available

    return cpu_kernels_available()


def _linears(weight: torch.Tensor, packed: bool):
    """x -> x @ weight.T by torch (F.linear) or by hpi_kernels' packed linear over the weight packed once."""
    if not packed:
        return lambda x: torch.nn.functional.linear(x, weight)
    from hpi_kernels.cpu import pack_linear_weight, packed_linear

    panels, out_features = pack_linear_weight(weight), weight.shape[0]
    return lambda x: packed_linear(x, panels, out_features)


def _gflops(m: int, k: int, n: int, dtype: torch.dtype, min_time_s: float, packed: bool = False) -> float:
    """Best single-call GFLOP/s over at least `min_time_s` (the best call is the least disturbed one)."""
    a, linear = torch.randn(m, k, dtype=dtype), _linears(torch.randn(n, k, dtype=dtype), packed)
    linear(a)
    best = float("inf")
    deadline = time.perf_counter() + min_time_s
    for _ in range(1000):
        t0 = time.perf_counter()
        linear(a)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return 2 * m * k * n / best / 1e9


def matmul_peak(model_dir: Path, dtypes=(torch.float32, torch.bfloat16), min_time_s: float = 0.4) -> dict:
    """{dtype: {"peak_gflops": best, "torch_peak_gflops", "packed_peak_gflops" (None without the C++
    kernels), "shapes": {"MxKxN": GFLOP/s}}} on the model's GEMM shapes (torch's; "packed MxKxN" the kernel's).

    Without native bf16 (AVX512-BF16/AMX) torch's bf16 matmul is ~10x slower than fp32 (which is why the
    runtime picks fp32 on such CPUs); there one shape shows it rather than the full grid."""
    from hpi_runtime.cpu_features import has_fast_bf16

    c = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    packed = _packed_kernels()
    out = {}
    for dtype in dtypes:
        shapes = {}
        grid = [(m, k, n) for m in (64, 128, 256) for k, n in ((hidden, inter), (inter, hidden), (hidden, 2 * inter))]
        if dtype == torch.bfloat16 and not has_fast_bf16():
            grid = grid[:1]
        for m, k, n in grid:
            shapes[f"{m}x{k}x{n}"] = _gflops(m, k, n, dtype, min_time_s)
        torch_peak = max(shapes.values())
        packed_peak = None
        if packed:
            for m, k, n in grid:
                shapes[f"packed {m}x{k}x{n}"] = _gflops(m, k, n, dtype, min_time_s, packed=True)
            packed_peak = max(v for key, v in shapes.items() if key.startswith("packed"))
        out[str(dtype).removeprefix("torch.")] = {
            "peak_gflops": max(torch_peak, packed_peak or 0.0), "torch_peak_gflops": torch_peak,
            "packed_peak_gflops": packed_peak, "shapes": shapes,
        }
    return out


def _weight_shapes(model_dir: Path) -> list[tuple[int, int]]:
    """(out, in) of every linear one token passes through, the LM head last."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q_dim, kv_dim = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    layer = [(q_dim + 2 * kv_dim, hidden), (hidden, q_dim), (2 * inter, hidden), (hidden, inter)]
    return layer * c["num_hidden_layers"] + [(c["vocab_size"], hidden)]


def batch1_floor(model_dir: Path, dtypes=(torch.float32, torch.bfloat16), repeats: int = 7) -> dict:
    """{dtype: {"weight_mb", "step_ms", "tok_s", "gb_s", "by"}}: one row through all the model's linears, by
    the faster of torch's GEMV and the packed kernel ("by" names it)."""
    out = {}
    for dtype in dtypes:
        weights = [torch.randn(n, k, dtype=dtype) for n, k in _weight_shapes(model_dir)]
        rows = {k: torch.randn(1, k, dtype=dtype) for _, k in _weight_shapes(model_dir)}
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        best, by = float("inf"), None
        for packed in (False, True) if _packed_kernels() else (False,):
            linears = [(_linears(w, packed), rows[w.shape[1]]) for w in weights]
            for _ in range(repeats + 1):  # the first pass warms up
                t0 = time.perf_counter()
                for linear, row in linears:
                    linear(row)
                elapsed = time.perf_counter() - t0
                if elapsed < best:
                    best, by = elapsed, "packed" if packed else "torch"
            del linears
        out[str(dtype).removeprefix("torch.")] = {
            "weight_mb": nbytes / 1e6, "step_ms": best * 1e3, "tok_s": 1 / best, "gb_s": nbytes / best / 1e9,
            "by": by,
        }
        del weights
    return out


if __name__ == "__main__":
    from hpi_runtime.model_source import resolve_model_dir

    model_dir, _ = resolve_model_dir(None)
    print(model_flops_per_token(model_dir))
    for dtype, result in matmul_peak(model_dir).items():
        packed = result["packed_peak_gflops"]
        print(dtype, f"{result['peak_gflops']:.1f} GFLOP/s (torch {result['torch_peak_gflops']:.1f}"
              + (f", packed kernel {packed:.1f})" if packed else ")"))
    for dtype, r in batch1_floor(model_dir).items():
        print(f"{dtype} batch-1 floor: {r['weight_mb']:.0f} MB of weights in {r['step_ms']:.1f} ms "
              f"({r['gb_s']:.1f} GB/s, {r['by']}) = {r['tok_s']:.1f} tok/s at most")
