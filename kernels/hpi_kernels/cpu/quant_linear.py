"""Weight-only int8 / int4 linear layers over prepacked weights on CPU (packed_linear_quant.cpp).

The portable formats of hpi_kernels.quant go in: int8 codes [N, K] with one scale per output channel; int4
codes [N, K // 2] (two per byte, the first k in the high nibble) with a scale and a zero per group of k,
w = (q - 8) * scale + zero. They are repacked once into column panels of PANEL outputs (32 with AVX512, 16
with AVX2), as the fp32 and bf16 packed linears are, so that each panel streams once per step while the
kernel widens it in registers and sums in fp32: fp32 FMAs, or, for bf16 activations on CPUs with
AVX512-BF16 where `bf16_tile` chose "dpbf16" (measured at start, as for the packed bf16 linear;
HPI_CPU_BF16_TILE=widen|dpbf16 overrides; where it chose "amx", whichever of those two measured faster),
vdpbf16ps over pairs of k (products exact either way). int4 scales and zeros are kept as bf16 pairs (the runtime
fits the codes against bf16 scales on CPU,
hpi_runtime.quantization.linear.op_dtype): a scale given in fp32 is rounded to bf16 here. int8 layers quantize x to
int8 per group of 32 k (W8A8, int8_a8_linear) where the runtime says so, as int4's do for W4A8. Prefill-sized inputs
(over 320 rows) go to MKL's sgemm over the weight dequantized into an fp32 scratch copy, or for bf16 x, where
`prefill_gemm` chose it on this CPU, to torch's bf16 GEMM over a bf16 copy (the dequantized weight rounded to
bf16: perplexity +0.04% here).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable

import torch

from hpi_kernels.cpu._extension import load_extension


def pack_int8_weight(
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N] float
) -> tuple[torch.Tensor, torch.Tensor]:  # (panels [ceil(N / PANEL), K, PANEL] int8, scales [panels * PANEL] fp32)
    """The int8 weight in int8_linear's panels; columns past N are zero. ValueError for bad shapes or dtypes."""
    load_extension()
    return torch.ops.hpi_kernels.pack_int8_weight(qweight, scales)


def int8_linear(
    x: torch.Tensor,  # [..., K] float32 or bfloat16
    packed: torch.Tensor,  # from pack_int8_weight
    scales: torch.Tensor,  # from pack_int8_weight
    out_features: int,
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:  # [..., N], x's dtype
    """x @ (q * scale).T + bias, summed in fp32 (the scale applied to each output's sum)."""
    load_extension()
    return torch.ops.hpi_kernels.int8_linear(x, packed, scales, out_features, bias)


def int8_logits(
    x: torch.Tensor,  # [..., K] float32 or bfloat16
    packed: torch.Tensor,  # from pack_int8_weight
    scales: torch.Tensor,  # from pack_int8_weight
    out_features: int,
) -> torch.Tensor:  # [..., N] float32
    """An int8 LM head's logits: int8_linear with its fp32 sums returned unrounded for bf16 x too
    (torch.ops.hpi_kernels.int8_logits, packed_logits' twin), so bf16 rounding does not decide near-ties."""
    load_extension()
    return torch.ops.hpi_kernels.int8_logits(x, packed, scales, out_features)


def int8_a8_linear(
    x: torch.Tensor,  # [..., K] float32 or bfloat16
    packed: torch.Tensor,  # from pack_int8_weight
    scales: torch.Tensor,  # from pack_int8_weight
    out_features: int,
    bias: torch.Tensor | None = None,  # [N], x's dtype
    max_rows: int = -1,  # W8A8 for inputs of at most this many rows, int8_linear above; -1: any number
) -> torch.Tensor:  # [..., N], x's dtype
    """int8_linear with x quantized to int8 per row and group of 32 k (W8A8, as llama.cpp's Q8_0 x Q8_0): each
    group's sum(x * q) becomes x_scale * sum(code * q) in exact integer arithmetic (x_scale = max|x| / 127 over the
    group, codes = round(x / x_scale), ties to even), the channel's scale applied to the row's total. vpdpbusd
    multiplies four k per lane and instruction where `int8_a8_tile()` is "vnni" (AVX512-VNNI with AVX512-VBMI, whose
    vpermi2b regroups the panels' bytes), "vnni_unpack" (AVX512-VNNI alone, byte and word unpacks) or "avxvnni" (the
    AVX2 build with AVX-VNNI, the same unpacks at 256 bits); plain loops elsewhere. K not a multiple of 32, or more
    rows than max_rows, take int8_linear's paths; with max_rows -1 a row's result does not depend on its batch's
    size."""
    load_extension()
    return torch.ops.hpi_kernels.int8_a8_linear(x, packed, scales, out_features, bias, max_rows)


def int8_a8_logits(
    x: torch.Tensor,  # [..., K] float32 or bfloat16
    packed: torch.Tensor,  # from pack_int8_weight
    scales: torch.Tensor,  # from pack_int8_weight
    out_features: int,
    max_rows: int = -1,  # as int8_a8_linear's: more rows take int8_logits whole
    rescore: int = 16,  # how many of each row's largest logits to recompute from float x
) -> torch.Tensor:  # [..., N] float32
    """An int8 LM head's logits with x in int8 (int8_a8_linear's W8A8 sums, fp32 out for bf16 x too), then in each row
    the `rescore` largest that are within one nat of its largest recomputed from x as it is (fp64 sums of x times
    the codes, times the channel's scale): x's rounding moves the other logits by its noise (hundredths of a nat on
    the embedded model), but the choice among near-ties is float x's."""
    load_extension()
    return torch.ops.hpi_kernels.int8_a8_logits(x, packed, scales, out_features, max_rows, rescore)


def int8_a8_tile() -> str:
    """The W8A8 tile this CPU runs: "vnni" (vpdpbusd, AVX512-VNNI and AVX512-VBMI, unless HPI_CPU_AVX512_VBMI=0),
    "vnni_unpack" (vpdpbusd, AVX512-VNNI without VBMI: Cascade Lake), "avxvnni" (256-bit vpdpbusd, the AVX2 build on
    a CPU with AVX-VNNI, unless HPI_CPU_AVX_VNNI=0) or "portable" (plain integer loops, correct anywhere and slower
    than int8_linear's float tiles: the runtime takes W8A8 by default only on the other three)."""
    load_extension()
    return torch.ops.hpi_kernels.int8_a8_tile()


def int8_weight_rows(
    packed: torch.Tensor,  # from pack_int8_weight
    scales: torch.Tensor,  # from pack_int8_weight
    rows: torch.Tensor,  # int64 ids of output channels
    dtype: torch.dtype,
) -> torch.Tensor:  # [*rows.shape, K] in dtype
    """Rows of the dequantized weight, q * scale, read from the panels (plain torch indexing, which torch.compile
    traces): an embedding tied to an int8 LM head looks tokens up here."""
    panel = packed.shape[2]
    codes = packed[rows // panel, :, rows % panel]  # [..., K] int8
    return (codes.to(torch.float32) * scales[rows].unsqueeze(-1)).to(dtype)


def pack_int4_weight(
    qweight: torch.Tensor,  # [N, K // 2] uint8
    scales: torch.Tensor,  # [N, K // group_size] float
    zeros: torch.Tensor,  # [N, K // group_size] float
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([ceil(N / PANEL), K // 8, PANEL] int32, [.., K // g, PANEL, 2] bf16)
    """The int4 weight in int4_linear's panels: a column's codes for 8 consecutive k per int32 word (k = 8j + i
    at bits 4i..4i+3); (scale, zero) pairs in bf16. Padding columns dequantize to 0. ValueError for bad
    shapes or a group size that is no multiple of 8."""
    load_extension()
    return torch.ops.hpi_kernels.pack_int4_weight(qweight, scales, zeros, group_size)


def int4_linear(
    x: torch.Tensor,  # [..., K] float32 or bfloat16
    packed: torch.Tensor,  # from pack_int4_weight
    scales_zeros: torch.Tensor,  # from pack_int4_weight
    group_size: int,
    out_features: int,
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:  # [..., N], x's dtype
    """x @ ((q - 8) * scale + zero).T + bias, the weight dequantized in registers, summed in fp32."""
    load_extension()
    return torch.ops.hpi_kernels.int4_linear(x, packed, scales_zeros, group_size, out_features, bias)


def int4_a8_linear(
    x: torch.Tensor,  # [..., K] float32 or bfloat16
    packed: torch.Tensor,  # from pack_int4_weight
    scales_zeros: torch.Tensor,  # from pack_int4_weight
    group_size: int,
    out_features: int,
    bias: torch.Tensor | None = None,  # [N], x's dtype
    max_rows: int = -1,  # W4A8 for inputs of at most this many rows, int4_linear above; -1: any number
) -> torch.Tensor:  # [..., N], x's dtype
    """int4_linear with x quantized to int8 per row and group of k (W4A8, as llama.cpp's Q4_0 x Q8_0): each
    group's sum(x * (q - 8)) becomes x_scale * sum(code * (q - 8)) in exact integer arithmetic, x_scale = max|x| /
    127 over the group and codes = round(x / x_scale) (ties to even); the zero point multiplies the exact sum of x.
    Integer dot products run four products per lane and instruction (vpdpbusd) where `int4_a8_tile()` is "vnni",
    vpmaddubsw + vpmaddwd where it is "avx2", plain loops elsewhere. With max_rows -1 at every row count,
    prefill-sized x too, so a row's result does not depend on the size of its batch or prefill chunk; where the
    float tiles are faster for many rows (bf16 x on AMX tiles), `int4_a8_max_rows` measures where to switch."""
    load_extension()
    return torch.ops.hpi_kernels.int4_a8_linear(x, packed, scales_zeros, group_size, out_features, bias, max_rows)


# Row counts int4_a8_max_rows times, ascending: decode batches, then a prefill chunk's size.
A8_ROW_LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 384)
A8_DEFAULT_SHAPE = (4096, 2048)  # [N, K] measured when the caller names none
_A8_MAX_WEIGHT = 8 << 20  # at most this many weights per measured copy (longer N is cut: the timing stays short)
_A8_STREAM_BYTES = 8 << 20  # this many bytes of int4 copies in turn (2 to 64 copies), so that they stream from memory


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@functools.cache
def int4_a8_max_rows(dtype: torch.dtype, shape: tuple[int, int] = A8_DEFAULT_SHAPE) -> int:
    """The most rows of `dtype` x for which W4A8 (int4_a8_linear) beats the float tiles (int4_linear) on this CPU,
    for a [N, K] = `shape` weight (the runtime passes its model's gate/up projection; K a multiple of 32), measured
    once per process and shape (int4_a8_linear's max_rows): -1 where it wins at every count of A8_ROW_LADDER up to
    a prefill chunk's, 0 where it never wins. Each count times both in alternation over copies of the weight that
    together stream from memory (N cut to at most 8M weights a copy); the first count where the float tiles win at
    it and at the next ends the search, so one noisy sample does not. HPI_CPU_INT4_A8_MAX_ROWS=<n> (or -1) sets it
    without measuring."""
    return _a8_max_rows("int4", dtype, shape)


@functools.cache
def int8_a8_max_rows(dtype: torch.dtype, shape: tuple[int, int] = A8_DEFAULT_SHAPE) -> int:
    """int4_a8_max_rows for W8A8: the most rows for which int8_a8_linear beats int8_linear's float tiles on this CPU
    (HPI_CPU_INT8_A8_MAX_ROWS=<n> or -1 sets it without measuring)."""
    return _a8_max_rows("int8", dtype, shape)


def _a8_max_rows(method: str, dtype: torch.dtype, shape: tuple[int, int]) -> int:
    variable = f"HPI_CPU_{method.upper()}_A8_MAX_ROWS"
    forced = os.environ.get(variable)
    if forced is not None:
        try:
            value = int(forced)
        except ValueError:
            value = -2
        if value < -1:
            raise ValueError(f"{variable} must be -1 (any) or a row count >= 0, got {forced!r}")
        return value
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{method}_a8_max_rows measures float32 or bfloat16 x, not {dtype}")
    n, k = shape
    if n < 1 or k < 32 or k % 32:
        raise ValueError(f"{method}_a8_max_rows needs a [N, K] shape with K a multiple of 32, got {shape}")
    generator = torch.Generator().manual_seed(0)
    n = min(n, max(_A8_MAX_WEIGHT // k, 1))
    weight_bytes = n * k // 2 if method == "int4" else n * k
    weights = []
    for _ in range(min(max(2, -(-_A8_STREAM_BYTES // weight_bytes)), 64)):
        if method == "int4":
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
            scales = torch.rand(n, k // 32, generator=generator) * 0.01 + 0.001
            weights.append(pack_int4_weight(codes, scales, torch.zeros_like(scales), 32))
        else:
            codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
            weights.append(pack_int8_weight(codes, torch.rand(n, generator=generator) * 0.01 + 0.001))
    ops = torch.ops.hpi_kernels
    best, float_wins = 0, 0
    for rows in A8_ROW_LADDER:
        x = torch.randn(rows, k, generator=generator).to(dtype)

        def run(a8: bool, x: torch.Tensor = x) -> None:
            for packed, scales in weights:
                if method == "int4":
                    (ops.int4_a8_linear if a8 else ops.int4_linear)(x, packed, scales, 32, n)
                elif a8:
                    ops.int8_a8_linear(x, packed, scales, n)
                else:
                    ops.int8_linear(x, packed, scales, n)

        run(True), run(False)  # warm: the scratch buffers, the first touch of the output
        a8_s, float_s = [], []
        for _ in range(5):  # alternating, so that a slow moment of the machine lands on both
            a8_s.append(_seconds(lambda: run(True)))
            float_s.append(_seconds(lambda: run(False)))
        if statistics.median(a8_s) <= statistics.median(float_s):
            best, float_wins = rows, 0
        else:
            float_wins += 1
            if float_wins == 2:
                return best
    return -1 if best == A8_ROW_LADDER[-1] else best


def int4_a8_tile() -> str:
    """The W4A8 tile this CPU runs: "vnni" (AVX512-VNNI's vpdpbusd), "avxvnni" (256-bit vpdpbusd, the AVX2 build
    on a CPU with AVX-VNNI, unless HPI_CPU_AVX_VNNI=0), "avx2" (vpmaddubsw, the AVX2 build) or "portable" (plain
    integer loops, correct anywhere and slower than int4_linear's float tiles: the runtime takes W4A8 by default only
    on the other three; AVX512 CPUs without VNNI get it)."""
    load_extension()
    return torch.ops.hpi_kernels.int4_a8_tile()
