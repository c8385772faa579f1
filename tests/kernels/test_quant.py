"""Quantization formats: round-trip error bounds, packing, and agreement with torch's own CPU ops."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels.quant import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    to_torch_scales_and_zeros,
    unpack_int4,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_is_within_half_a_step(dtype) -> None:
    weight = (torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]).to(dtype)
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape
    assert scales.shape == (64,) and scales.dtype == dtype
    error = (dequantize_int8(q, scales) - weight.float()).abs()
    assert (error <= scales.float()[:, None] * 0.5001).all()
    assert q.abs().max() <= 127


def test_int4_pack_unpack_and_nibble_order() -> None:
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert int(pack_int4(torch.tensor([[1, 2]], dtype=torch.uint8))) == 0x12  # even k in the high nibble


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_round_trip_is_within_half_a_step(group_size, dtype) -> None:
    weight = (torch.randn(32, 256) + torch.randn(32, 1)).to(dtype)  # offset rows: groups not centred on 0
    packed, scales, zeros = quantize_int4(weight, group_size)
    assert packed.shape == (32, 128) and scales.shape == zeros.shape == (32, 256 // group_size)
    error = (dequantize_int4(packed, scales, zeros, group_size) - weight.float()).abs()
    step = scales.float().repeat_interleave(group_size, dim=1)
    # Half a step, plus the rounding of the stored zero when it is kept in bf16.
    slack = 0.5 * zeros.float().abs().repeat_interleave(group_size, dim=1) * 2**-7 if dtype == torch.bfloat16 else 0
    assert (error <= step * 0.5001 + slack).all()
    relative = (error.norm() / weight.float().norm()).item()
    assert relative < 0.1


def test_int4_constant_group_does_not_divide_by_zero() -> None:
    weight = torch.full((16, 64), 0.25)
    packed, scales, zeros = quantize_int4(weight, 32)
    torch.testing.assert_close(dequantize_int4(packed, scales, zeros, 32), weight)


def test_int4_format_matches_torch_cpu_int4_matmul() -> None:
    """One quantized state dict serves torch's CPU op and the Triton kernels."""
    weight, x = torch.randn(32, 128), torch.randn(3, 128)
    packed, scales, zeros = quantize_int4(weight, 64)
    torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(packed).to(torch.int32), 1)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch_packed, 64, to_torch_scales_and_zeros(scales, zeros))
    expected = x @ dequantize_int4(packed, scales, zeros, 64).T
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_int8_format_matches_torch_cpu_int8_matmul() -> None:
    weight, x = torch.randn(32, 128), torch.randn(3, 128)
    q, scales = quantize_int8(weight)
    out = torch.ops.aten._weight_int8pack_mm(x, q, scales)
    torch.testing.assert_close(out, x @ dequantize_int8(q, scales).T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: quantize_int4(torch.randn(4, 96), 64), "multiple of group_size"),
        (lambda: quantize_int4(torch.randn(4, 96), 48), "group_size must be one of"),
        (lambda: quantize_int8(torch.randint(0, 3, (4, 8))), "float"),
        (lambda: pack_int4(torch.zeros(4, 7, dtype=torch.uint8)), "even K"),
    ],
)
def test_quant_validation(call, message) -> None:
    with pytest.raises(ValueError, match=message):
        call()
