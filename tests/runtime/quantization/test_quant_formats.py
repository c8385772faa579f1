"""The offline step: round-trip error bounds, config validation, and the CPU int4 repacking.

Error bound: a weight w quantized as q = round(w / s) (int8) or q = round((w - z) / s + 8) (int4) is
dequantized to a grid point at most half a step from w, so |dequant(q) - w| <= s / 2 per element, with
s the scale of w's channel (int8) or group (int4); 0.5001 allows fp32 rounding of w / s.
"""

from __future__ import annotations

import pytest
import torch

from hpi_runtime.quantization.linear import QuantizedWeight, pack_int4_for_cpu
from hpi_runtime.quantization.quantize import QuantizationConfig, quantize_weight


def _weight(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Rows with very different magnitudes and offsets: per-channel / per-group scales must follow them.
    rows = torch.logspace(-3, 1, n)[:, None]
    return torch.randn(n, k, generator=generator) * rows + torch.randn(n, 1, generator=generator) * rows


def test_int8_round_trip_within_half_a_step() -> None:
    weight = _weight()
    qw = quantize_weight(weight, QuantizationConfig("int8"))
    assert qw.qweight.dtype == torch.int8 and qw.qweight.shape == weight.shape and qw.scales.shape == (48,)
    error = (qw.dequantize() - weight).abs()
    assert (error <= 0.5001 * qw.scales[:, None]).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_minmax_round_trip_within_half_a_step(group_size: int) -> None:
    weight = _weight()
    qw = quantize_weight(weight, QuantizationConfig("int4", group_size, int4_fit="minmax"))
    assert qw.qweight.dtype == torch.uint8 and qw.qweight.shape == (48, 128)  # two values per byte
    assert qw.scales.shape == qw.zeros.shape == (48, 256 // group_size)
    error = (qw.dequantize() - weight).abs()
    step = qw.scales.repeat_interleave(group_size, dim=1)
    assert (error <= 0.5001 * step).all()


def test_bf16_scales_are_rounded_before_the_codes() -> None:
    """Codes are chosen against the stored bf16 scale, so the half-step bound holds for what is stored."""
    weight = _weight()
    qw = quantize_weight(weight, QuantizationConfig("int8"), scale_dtype=torch.bfloat16)
    assert qw.scales.dtype == torch.bfloat16
    assert ((qw.dequantize() - weight).abs() <= 0.5001 * qw.scales.float()[:, None]).all()


def test_cpu_int4_repacking_pads_n_to_16_with_zero_rows() -> None:
    weight = _weight(n=40, k=64)
    qw = quantize_weight(weight, QuantizationConfig("int4", 32))
    packed, scales_and_zeros = pack_int4_for_cpu(qw)
    assert packed.shape == (48, 32) and scales_and_zeros.shape == (2, 48, 2)
    x = torch.randn(3, 64)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)
    torch.testing.assert_close(out[:, :40], x @ qw.dequantize().T, atol=1e-4, rtol=1e-4)
    assert (out[:, 40:] == 0).all()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: QuantizationConfig("fp8"), "quantization must be one of"),
        (lambda: QuantizationConfig("int4", 48), "group size must be one of"),
        (lambda: QuantizationConfig("int4", int4_fit="hqq"), "int4_fit must be one of"),
        (lambda: QuantizationConfig("int4", int4_policy="q4km"), "int4_policy must be one of"),
        (lambda: quantize_weight(torch.randn(16, 96), QuantizationConfig("int4", 64)), "does not divide"),
        (lambda: quantize_weight(torch.randn(16, 64), QuantizationConfig("none")), "not 'none'"),
        (lambda: quantize_weight(torch.randn(16), QuantizationConfig("int8")), r"\[N, K\]"),
    ],
)
def test_bad_input_raises_value_error(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_quantized_weight_reports_its_logical_shape() -> None:
    qw = quantize_weight(torch.randn(16, 64), QuantizationConfig("int4", 32))
    assert isinstance(qw, QuantizedWeight) and (qw.out_features, qw.in_features) == (16, 64)
