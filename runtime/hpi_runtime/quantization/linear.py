"""Weight-only quantized linear layers: int8 / int4 weights in memory, the matmul op picked by device.

CPU, fp32 or bf16 activations: hpi_kernels' packed tiles (`hpi_kernels.cpu.quant_linear`, where the C++ CPU
kernels build): the portable weight repacked once into column panels that stream once per step, widened to
fp32 in registers, summed in fp32; activations are not rounded, except that int4 and int8 layers quantize them
to int8 per group of k (W4A8 `int4_a8_linear`, W8A8 `int8_a8_linear`) where `int4_activations` /
`int8_activations` say so (by default where the tile has integer dot products, AVX512-VNNI or, for int4, the
AVX2 build, up to the row count where it measures faster than the float tiles; a8_rows). Elsewhere on CPU (fp16
activations, or no C++ toolchain) torch's packed ops, `aten._weight_int8pack_mm` (int8 [N, K] + per-channel scales) and
`aten._weight_int4pack_mm_for_cpu` (its own int4 tile layout, made once here by
`aten._convert_weight_to_int4pack_for_cpu`, N a multiple of 16, scales/zeros as [K // g, N, 2]).
CUDA: hpi_kernels' Triton `int8_weight_only_matmul` / `int4_weight_only_matmul` over the portable
layout of hpi_kernels.quant. The ops want their scales in one dtype (op_dtype), so a layer is built for one
(device type, activation dtype); the portable `QuantizedWeight` is what stays device-neutral.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hpi_kernels.cpu import (
    A8_DEFAULT_SHAPE,
    cpu_kernels_available,
    int4_a8_max_rows,
    int4_a8_tile,
    int8_a8_max_rows,
    int8_a8_tile,
    int8_weight_rows,
    pack_int4_weight,
    pack_int8_weight,
)
from hpi_kernels.quant import dequantize_int4, dequantize_int8, to_torch_scales_and_zeros, unpack_int4

# Per weight format: its x-in-int8 tile's name on this CPU ("portable" where it has no integer dot-product
# instructions) and the row count up to which it measures faster than the float tiles.
_A8_TILES = {"int4": (int4_a8_tile, int4_a8_max_rows), "int8": (int8_a8_tile, int8_a8_max_rows)}
CPU_INT4_N_MULTIPLE = 16  # aten._convert_weight_to_int4pack_for_cpu rejects other N
# fp32 activations on CPU, int8 weights: from this many rows on (prefill chunks, big batches) dequantizing the
# layer and running torch's fp32 GEMM beats the packed op's bf16 path on CPUs without native bf16 (AVX2
# here, a [3072, 576] layer: 1.3x at 256 rows, 1.9x at 2048; the packed op wins below ~128 rows, and decode
# keeps reading 1 byte per weight). int4's CPU tile layout has no cheap dequantization, so it stays packed.
CPU_INT8_DEQUANT_MIN_ROWS = 256


def op_dtype(device: torch.device, activation_dtype: torch.dtype) -> torch.dtype:
    """The dtype the quantized weight's scales are kept in (the codes are fitted against them as stored), and
    the dtype torch's CPU ops compute in.

    On CPU that is bf16 for fp32 activations: hpi_kernels' int4 panels keep (scale, zero) as bf16 pairs, and
    torch's fp32 CPU kernels for the packed ops, the fallback, are scalar (16-32x slower than their bf16
    kernels on an AVX2 CPU at 443 rows, see docs/quantization.md), so that fallback rounds fp32 activations to
    bf16 at the matmul's input (2**-9 relative, below int8's own weight error) and casts the result back.
    hpi_kernels' tiles and the Triton kernels take fp32 activations as they are.
    """
    if torch.device(device).type == "cpu" and activation_dtype == torch.float32:
        return torch.bfloat16
    return activation_dtype


def a8_rows(method: str, setting: str, device: torch.device | str, dtype: torch.dtype,
            shape: tuple[int, int] | None = None) -> int:  # fmt: skip
    """Up to how many rows `method` ("int4", "int8") layers quantize their `dtype` activations to int8 per group of k
    (W4A8, W8A8) for `int4_activations` / `int8_activations` = setting ("auto", "int8", "float") on this device: 0
    (never: float x), -1 (at every row count) or a count, measured on a weight of `shape` ([N, K]: the model's gate/up
    projection; None: hpi_kernels' default). Only hpi_kernels' CPU panels (fp32 and bf16 x) have these ops. "int8" takes
    them at every count; "auto" where the tile has integer dot products (int4: vpdpbusd with AVX512-VNNI, or in the AVX2
    build with AVX-VNNI, else vpmaddubsw; int8: vpdpbusd with AVX512-VNNI, or AVX-VNNI in the AVX2 build), not
    where it is plain loops, and up to the row count where it measures faster than the float tiles on this CPU
    (hpi_kernels' int4_a8_max_rows / int8_a8_max_rows: W4A8 at every count on the AVX512-VNNI EPYC, 12-16 rows with bf16
    x on AMX tiles; docs/quantization.md, "W4A8" and "W8A8"). ValueError for "int8" on another device."""
    if torch.device(device).type != "cpu":
        if setting == "int8":
            raise ValueError(f"{method}_activations int8 (W{method[3]}A8) runs on CPU only, not "
                             f"{torch.device(device).type}")  # fmt: skip
        return 0
    if setting == "int8":
        return -1
    if setting != "auto" or dtype not in (torch.float32, torch.bfloat16):
        return 0
    tile, max_rows = _A8_TILES[method]
    if not (cpu_kernels_available() and tile() != "portable"):
        return 0
    return max_rows(dtype, shape or A8_DEFAULT_SHAPE)  # one cache entry per shape, named or not


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear weight in the portable format of hpi_kernels.quant (the offline step's output)."""

    method: str  # "int8" | "int4"
    qweight: torch.Tensor  # int8: [N, K] int8; int4: [N, K // 2] uint8, byte j = (q[2j] << 4) | q[2j + 1]
    scales: torch.Tensor  # int8: [N]; int4: [N, K // group_size]
    zeros: torch.Tensor | None = None  # int4: [N, K // group_size], w = (q - 8) * scale + zero
    group_size: int | None = None  # int4 only

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.method == "int4" else 1)

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32
        if self.method == "int8":
            return dequantize_int8(self.qweight, self.scales)
        assert self.zeros is not None and self.group_size is not None
        return dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size)


def pack_int4_for_cpu(
    weight: QuantizedWeight,
) -> tuple[torch.Tensor, torch.Tensor]:  # (packed [N_pad, K // 2] uint8 in torch's CPU tile layout, [K // g, N_pad, 2])
    """The portable int4 weight in the layout `aten._weight_int4pack_mm_for_cpu` takes; N padded to 16.

    Pad rows hold q = 8 with scale 0 and zero 0, so they dequantize to exactly 0.
    """
    n = weight.out_features
    pad = -n % CPU_INT4_N_MULTIPLE
    q = unpack_int4(weight.qweight).to(torch.int32)  # [N, K]
    scales, zeros = weight.scales, weight.zeros
    assert zeros is not None
    if pad:
        q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return packed, to_torch_scales_and_zeros(scales, zeros)


def uses_cpu_panels(weight: QuantizedWeight, activation_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a CPU layer runs on hpi_kernels' int8/int4 panels: fp32 or bf16 activations, int4 groups of a
    multiple of 8 (the panels hold 8 codes per word), and the C++ kernels built here."""
    if torch.device(device).type != "cpu" or activation_dtype not in (torch.float32, torch.bfloat16):
        return False
    if weight.method == "int4" and (weight.group_size or 0) % 8 != 0:
        return False
    return cpu_kernels_available()


class QuantizedLinear(nn.Module):
    """y = x @ dequant(W).T + b with W kept quantized; built for one device type and activation dtype.

    The quantized tensors are frozen `nn.Parameter`s so that `model.parameters()` (and with it the
    reported weight footprint and device lookups) sees them like any other weight.
    """

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,  # activation dtype
        device: torch.device,
        input_perm: torch.Tensor | None = None,  # [K] int64: the weight's columns are x's in this order
        activations: str = "float",  # "auto" | "int8" | "float": x in int8 per group of k or not, see a8_rows
        a8_max_rows: int = -1,  # activations "int8": x in int8 up to this many rows, float x above (-1: all)
    ) -> None:
        super().__init__()
        self.activation_dtype = dtype
        scale_dtype = op_dtype(device, dtype)
        self.method, self.group_size = weight.method, weight.group_size
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.device_type = torch.device(device).type
        self.cpu_panels = uses_cpu_panels(weight, dtype, device)
        # W4A8 / W8A8: the panels with x quantized to int8 per group (hpi_kernels' int4_a8_linear, int8_a8_linear)
        # up to a8_max_rows rows.
        rows = a8_rows(self.method, activations, device, dtype) if self.cpu_panels else 0
        if rows == -1 and activations == "int8":
            rows = a8_max_rows
        self.int8_activations, self.a8_max_rows = rows != 0, rows

        def frozen(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.to(device).contiguous(), requires_grad=False)

        if self.cpu_panels and self.method == "int8":
            packed, scales = pack_int8_weight(weight.qweight.cpu(), weight.scales.to(scale_dtype))
            self.qweight = frozen(packed)  # [N / PANEL, K, PANEL] int8 panels
            self.scales = frozen(scales)  # [N / PANEL * PANEL] fp32 (the bf16 scales, widened)
        elif self.cpu_panels:
            assert weight.zeros is not None and weight.group_size is not None
            packed, scales_and_zeros = pack_int4_weight(weight.qweight.cpu(), weight.scales.to(scale_dtype),
                                                        weight.zeros.to(scale_dtype), weight.group_size)  # fmt: skip
            self.qweight = frozen(packed)  # [N / PANEL, K / 8, PANEL] int32: 8 codes of a column per word
            self.scales_and_zeros = frozen(scales_and_zeros)  # [N / PANEL, K / g, PANEL, 2] bf16
        elif self.method == "int8":
            self.qweight = frozen(weight.qweight)  # [N, K] int8
            self.scales = frozen(weight.scales.to(scale_dtype))  # [N]
        elif self.device_type == "cpu":
            packed, scales_and_zeros = pack_int4_for_cpu(weight)
            self.qweight = frozen(packed)  # [N_pad, K // 2] uint8, torch's CPU tile layout
            self.scales_and_zeros = frozen(scales_and_zeros.to(scale_dtype))  # [K // g, N_pad, 2]
        else:
            assert weight.zeros is not None
            self.qweight = frozen(weight.qweight)  # [N, K // 2] uint8, hpi_kernels.quant layout
            self.scales = frozen(weight.scales.to(scale_dtype))  # [N, K // g]
            self.zeros = frozen(weight.zeros.to(scale_dtype))  # [N, K // g]
        self.bias = None if bias is None else frozen(bias.to(self.activation_dtype))
        # GPTQ act-order checkpoints: groups are contiguous only after permuting the input channels, so the
        # layer gathers x's columns into that order (one [M, K] index_select) and the kernels stay as they are.
        self.register_buffer("input_perm", None if input_perm is None else input_perm.to(device, torch.int64))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.method == "int4" else ""
        perm = ", input_perm" if self.input_perm is not None else ""
        rows = "" if self.a8_max_rows == -1 else f" up to {self.a8_max_rows} rows"
        panels = (", hpi_kernels panels" + (f", int8 activations{rows}" if self.int8_activations else "")
                  if self.cpu_panels else "")  # fmt: skip
        return f"{self.in_features}, {self.out_features}, {self.method}{group}{perm}, {self.device_type}{panels}"

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] contiguous -> [M, N]
        if x.device.type != self.device_type:
            raise RuntimeError(f"QuantizedLinear was packed for {self.device_type}, got input on {x.device.type}")
        if self.device_type == "cpu":
            if self.method == "int8":
                return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size, self.scales_and_zeros)
            return out if out.shape[1] == self.out_features else out[:, : self.out_features].contiguous()
        from hpi_kernels.quant_matmul import int4_weight_only_matmul, int8_weight_only_matmul

        if self.method == "int8":
            return int8_weight_only_matmul(x, self.qweight, self.scales)
        return int4_weight_only_matmul(x, self.qweight, self.scales, self.zeros, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if self.input_perm is not None:
            rows = rows.index_select(1, self.input_perm)
        if self.cpu_panels:
            out = self._panel_forward(rows)
        elif not self._may_dequantize(rows):
            out = self._packed_forward(rows)
        elif torch.compiler.is_compiling():  # the row count is unbacked there: both branches go in the graph
            out = torch.cond(rows.shape[0] >= CPU_INT8_DEQUANT_MIN_ROWS, self._dequantized_forward,
                             self._packed_forward, (rows,))  # fmt: skip
        elif rows.shape[0] >= CPU_INT8_DEQUANT_MIN_ROWS:
            out = self._dequantized_forward(rows)
        else:
            out = self._packed_forward(rows)
        return out.reshape(*lead, self.out_features)

    def _panel_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """hpi_kernels' C++ ops, called directly (opaque to torch.compile, which sees their fake kernels)."""
        x = rows.to(self.activation_dtype)
        if self.method == "int8" and self.int8_activations:
            out = torch.ops.hpi_kernels.int8_a8_linear(x, self.qweight, self.scales, self.out_features, self.bias,
                                                       self.a8_max_rows)  # fmt: skip
        elif self.method == "int8":
            out = torch.ops.hpi_kernels.int8_linear(x, self.qweight, self.scales, self.out_features, self.bias)
        elif self.int8_activations:
            out = torch.ops.hpi_kernels.int4_a8_linear(x, self.qweight, self.scales_and_zeros, self.group_size,
                                                       self.out_features, self.bias, self.a8_max_rows)  # fmt: skip
        else:
            out = torch.ops.hpi_kernels.int4_linear(x, self.qweight, self.scales_and_zeros, self.group_size,
                                                    self.out_features, self.bias)  # fmt: skip
        return out.to(rows.dtype)

    def _packed_forward(self, rows: torch.Tensor) -> torch.Tensor:
        out = self._matmul(rows.to(self.compute_dtype).contiguous()).to(rows.dtype)
        return out if self.bias is None else out + self.bias

    def _dequantized_forward(self, rows: torch.Tensor) -> torch.Tensor:
        weight = self.qweight.to(rows.dtype) * self.scales.to(rows.dtype)[:, None]  # one layer, transient
        return torch.nn.functional.linear(rows, weight, self.bias)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized int8 weight, [*ids.shape, in_features] in the activation dtype: an
        embedding tied to this layer (a quantized LM head) looks tokens up here."""
        if self.method != "int8":
            raise ValueError(f"weight_rows reads int8 weights only, this layer is {self.method}")
        if self.cpu_panels:
            return int8_weight_rows(self.qweight, self.scales, ids, self.activation_dtype)
        return (self.qweight[ids].to(torch.float32) * self.scales[ids].float().unsqueeze(-1)).to(self.activation_dtype)

    def _may_dequantize(self, rows: torch.Tensor) -> bool:
        """Whether a step with enough rows dequantizes this layer (see CPU_INT8_DEQUANT_MIN_ROWS)."""
        return (self.device_type == "cpu" and self.method == "int8" and rows.dtype == torch.float32
                and self.compute_dtype != torch.float32)  # fmt: skip

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmul runs in: the dtype its scales are stored in (see op_dtype)."""
        scales = self.scales if hasattr(self, "scales") else self.scales_and_zeros
        return scales.dtype
