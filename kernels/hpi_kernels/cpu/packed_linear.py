"""Linear layers over prepacked weights on CPU (packed_linear.cpp, packed_linear_bf16.cpp): fp32 and bf16.

`pack_linear_weight` turns a [out_features, in_features] weight into column panels, zero-padded past
out_features: fp32 [panels, in_features, PANEL], bf16 [panels, ceil(in_features / 2), PANEL, 2] (pairs of k);
PANEL = 32 columns with AVX512, 16 with AVX2. `packed_linear` is `F.linear` over it.

Up to a few hundred rows the kernel streams each panel once while it computes. fp32: 1.3-1.8x MKL's sgemm
at 8-64 rows here, as fast at one row. bf16: one of three tiles, whichever `bf16_tile` measured faster on this CPU
at start (the third, "amx", on CPUs with AMX-BF16: packed_linear_amx.cpp): "widen" widens the weight's pairs
to fp32 in registers for fp32 FMAs, so it runs at fp32's FMA rate over half the bytes (1.8-2.3x fp32 at 1-8
rows, even at 32-64, 2x torch's bf16 GEMM where the CPU has no AMX); "dpbf16" (CPUs with AVX512-BF16) multiplies
the pairs as they are with vdpbf16ps, half the instructions per k.
Both sum in fp32. Prefill-sized inputs go to MKL's sgemm over the weight unpacked into a
per-thread fp32 scratch buffer (bf16 x and weight widened, rounded once), or, for bf16 x where `prefill_gemm`
found it faster on this CPU (AVX512-BF16 or AMX), to torch's bf16 GEMM over a bf16 copy. A row's result does not
depend on the other rows below that size.

fp32 x also runs over bf16 panels (an fp32 model whose weights are bf16 values: the runtime packs a bf16
checkpoint's weights so, at half the bytes): the widen tile, whose fp32 sums are the fp32 panels' bit for bit.
"""

from __future__ import annotations

import torch

from hpi_kernels.cpu._extension import load_extension


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out_features, in_features] float32 or bfloat16 CPU (any strides) -> the packed panels, contiguous.

    Raises ValueError for another dtype, device or rank; CpuKernelBuildError without a toolchain."""
    load_extension()
    return torch.ops.hpi_kernels.pack_linear_weight(weight)


def packed_linear(
    x: torch.Tensor,  # [..., in_features] float32 or bfloat16
    packed: torch.Tensor,  # from pack_linear_weight, of x's dtype (or bf16 under fp32 x)
    out_features: int,
    bias: torch.Tensor | None = None,  # [out_features], x's dtype
    residual: torch.Tensor | None = None,  # [..., out_features], x's dtype
) -> torch.Tensor:  # [..., out_features]
    """x @ weight.T + bias (+ residual) over the packed weight (torch.ops.hpi_kernels.packed_linear, which models
    call directly). The residual (a decoder layer's residual stream) joins the fp32 sums of prefill-sized GEMMs,
    rounded once, and is added after the tiles below that size. A packed weight of another CPU capability's panel
    width, or mismatched shapes, raise ValueError."""
    load_extension()
    return torch.ops.hpi_kernels.packed_linear(x, packed, out_features, bias, residual)


def packed_logits(
    x: torch.Tensor,  # [..., in_features] float32 or bfloat16
    packed: torch.Tensor,  # from pack_linear_weight, of x's dtype (or bf16 under fp32 x)
    out_features: int,
) -> torch.Tensor:  # [..., out_features] float32
    """An LM head's logits, x @ weight.T with the kernel's fp32 sums returned unrounded for bf16 x too
    (torch.ops.hpi_kernels.packed_logits): bf16's steps of 0.125 at logits of 16-32 would otherwise decide
    near-ties under argmax."""
    load_extension()
    return torch.ops.hpi_kernels.packed_logits(x, packed, out_features)


def prefill_gemm(choice: str = "") -> str:
    """How prefill-sized GEMMs with bf16 activations run (the packed bf16 linear's, and int8/int4 over their
    dequantized weight): "bf16" (torch's bf16 GEMM, oneDNN) or "fp32" (MKL's sgemm, x and weight widened).
    "" returns the current choice, measured on this CPU at first use unless HPI_CPU_PREFILL_GEMM=bf16|fp32 set it;
    "auto" measures again, "bf16" / "fp32" force one (tests run both on any machine). ValueError otherwise."""
    load_extension()
    return torch.ops.hpi_kernels.prefill_gemm(choice)


def bf16_tile(choice: str = "") -> str:
    """The tile the packed bf16 GEMMs (up to prefill size, and the LM head's logits) run: "widen" (the pairs
    widened to fp32 for FMAs), "dpbf16" (vdpbf16ps on the pairs; AVX512-BF16 CPUs only) or "amx" (AMX tiles over
    the panels as they are, packed_linear_amx.cpp; AMX-BF16 CPUs only, weights whose in_features are a multiple of
    32; the int8/int4 tiles then take widen or dpbf16, whichever measured faster). "" returns the current choice,
    measured on this CPU at first use (one request's decode and a batch's on a weight streamed from memory) unless
    HPI_CPU_BF16_TILE=widen|dpbf16|amx set it; "auto" measures again; a name forces that tile (tests run each the
    CPU has). ValueError for another name, or a tile this CPU lacks."""
    load_extension()
    return torch.ops.hpi_kernels.bf16_tile(choice)


def packed_weight_rows(packed: torch.Tensor, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """weight[rows] read from the packed weight ([*rows.shape, in_features]; plain torch indexing, which
    torch.compile traces): an embedding that shares its matrix with a packed LM head looks tokens up here."""
    panel = packed.shape[2]
    picked = packed[rows // panel, :, rows % panel]  # fp32 [..., K]; bf16 [..., ceil(K / 2), 2]
    return picked if packed.dim() == 3 else picked.flatten(-2)[..., :in_features]
