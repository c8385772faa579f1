"""The data-free int4 fit: never worse than min/max per group, clearly better on heavy-tailed weights."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels.quant import quantize_int4
from hpi_runtime.quantization.quantize import QuantizationConfig, quantize_weight


def _group_sq_error(weight: torch.Tensor, approx: torch.Tensor, group_size: int) -> torch.Tensor:  # [N * K // g]
    return (approx.float() - weight.float()).reshape(-1, group_size).square().sum(-1)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 128])
def test_mse_fit_beats_min_max_on_heavy_tailed_weights(scale_dtype: torch.dtype, group_size: int) -> None:
    generator = torch.Generator().manual_seed(0)
    # Student-t(4): the heavy tails of trained LLM weights, where one outlier stretches a min/max group.
    weight = torch.distributions.StudentT(4.0).sample((192, 512)) * 0.02
    weight += 0.01 * torch.randn(192, 1, generator=generator)  # per-row offsets: zeros must follow them
    fit = quantize_weight(weight, QuantizationConfig("int4", group_size), scale_dtype)
    minmax = quantize_weight(weight, QuantizationConfig("int4", group_size, int4_fit="minmax"), scale_dtype)
    assert fit.scales.dtype == fit.zeros.dtype == scale_dtype and fit.qweight.shape == minmax.qweight.shape
    fit_error = _group_sq_error(weight, fit.dequantize(), group_size)
    minmax_error = _group_sq_error(weight, minmax.dequantize(), group_size)
    assert (fit_error <= minmax_error * (1 + 1e-5) + 1e-12).all()  # min/max is one candidate of the search
    assert fit_error.sum() < 0.9 * minmax_error.sum()


def test_minmax_fit_is_the_kernels_quantizer() -> None:
    weight = torch.randn(32, 128)
    qw = quantize_weight(weight, QuantizationConfig("int4", 64, int4_fit="minmax"), torch.bfloat16)
    packed, scales, zeros = quantize_int4(weight, 64, torch.bfloat16)
    assert torch.equal(qw.qweight, packed) and torch.equal(qw.scales, scales) and torch.equal(qw.zeros, zeros)


def test_mse_fit_keeps_a_constant_group_exact() -> None:
    """A group of identical values has no range: the step must not become 0/0 and the value must survive."""
    weight = torch.full((16, 64), 0.25)
    weight[:, 32:] = torch.linspace(-1, 1, 32)
    qw = quantize_weight(weight, QuantizationConfig("int4", 32), torch.float32)
    assert torch.isfinite(qw.scales).all() and torch.isfinite(qw.zeros).all()
    torch.testing.assert_close(qw.dequantize()[:, :32], weight[:, :32], atol=1e-6, rtol=0)
