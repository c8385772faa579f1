"""Weight-only INT8/INT4 matmul kernels against dequantize-then-matmul."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import int4_weight_only_matmul, int8_weight_only_matmul
from hpi_kernels.quant import quantize_int4, quantize_int8
from hpi_kernels.reference import int4_weight_only_matmul_ref, int8_weight_only_matmul_ref

N, K = 40, 256  # N not a multiple of the N tile: masked edge columns

SHAPES = [
    # (M, dtype, non_contiguous): M=1 and 5 take the decode tiles, 70 the prefill tiles.
    pytest.param(1, torch.float32, False, id="m1-fp32"),
    pytest.param(5, torch.float16, True, id="m5-fp16-noncontig"),
    pytest.param(70, torch.float16, False, id="m70-fp16"),
    pytest.param(20, torch.float32, True, id="m20-fp32-noncontig"),
    pytest.param(3, torch.bfloat16, False, id="m3-bf16"),  # upcast after load in the interpreter
]


def _x(m: int, dtype: torch.dtype, non_contiguous: bool, device: torch.device) -> torch.Tensor:
    if non_contiguous:
        return torch.randn(K, m).to(device, dtype).T  # column-major activations
    return torch.randn(m, K).to(device, dtype)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # Sums of 256 products of magnitude ~1: fp16 output rounding dominates.
    return {
        torch.float32: {"atol": 1e-3, "rtol": 1e-4},
        torch.float16: {"atol": 2e-2, "rtol": 2e-3},
        torch.bfloat16: {"atol": 1e-1, "rtol": 1.6e-2},
    }[dtype]


@pytest.mark.parametrize("m,dtype,non_contiguous", SHAPES)
def test_int8_matmul_matches_reference(device, m, dtype, non_contiguous) -> None:
    torch.manual_seed(0)
    weight, scales = quantize_int8(torch.randn(N, K).to(device, dtype))
    x = _x(m, dtype, non_contiguous, device)
    out = int8_weight_only_matmul(x, weight, scales)
    assert out.shape == (m, N) and out.dtype == dtype
    torch.testing.assert_close(out, int8_weight_only_matmul_ref(x, weight, scales), **_tol(dtype))


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("m,dtype,non_contiguous", SHAPES)
def test_int4_matmul_matches_reference(device, m, dtype, non_contiguous, group_size) -> None:
    torch.manual_seed(0)
    packed, scales, zeros = quantize_int4(torch.randn(N, K).to(device, dtype), group_size)
    x = _x(m, dtype, non_contiguous, device)
    out = int4_weight_only_matmul(x, packed, scales, zeros, group_size)
    assert out.shape == (m, N) and out.dtype == dtype
    expected = int4_weight_only_matmul_ref(x, packed, scales, zeros, group_size)
    torch.testing.assert_close(out, expected, **_tol(dtype))


def test_int4_matmul_with_fp32_scales_and_group_64(device) -> None:
    weight = torch.randn(N, K, dtype=torch.float16, device=device)
    packed, scales, zeros = quantize_int4(weight, 64, scale_dtype=torch.float32)
    x = torch.randn(3, K, dtype=torch.float16, device=device)
    expected = int4_weight_only_matmul_ref(x, packed, scales, zeros, 64)
    torch.testing.assert_close(int4_weight_only_matmul(x, packed, scales, zeros, 64), expected, **_tol(x.dtype))


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"x": torch.randn(2, K - 2)}, "x.shape\\[1\\]"),
        ({"x": torch.randn(K)}, "x must be"),
        ({"weight": torch.zeros(N, K, dtype=torch.uint8)}, "weight must have dtype"),
        ({"scales": torch.ones(N + 1)}, "scales.shape"),
        ({"scales": torch.ones(N, dtype=torch.int32)}, "scales must have dtype"),
    ],
)
def test_int8_validation(overrides, message) -> None:
    args = {"x": torch.randn(2, K), "weight": torch.zeros(N, K, dtype=torch.int8), "scales": torch.ones(N)}
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        int8_weight_only_matmul(**args)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"packed": torch.zeros(N, K // 2, dtype=torch.int8)}, "packed must have dtype"),
        ({"group_size": 48}, "group_size must be one of"),
        ({"zeros": torch.zeros(N, 3)}, "zeros must be"),
        ({"scales": torch.ones(N, 2, 1)}, "scales must be"),
    ],
)
def test_int4_validation(overrides, message) -> None:
    args = {
        "x": torch.randn(2, K),
        "packed": torch.zeros(N, K // 2, dtype=torch.uint8),
        "scales": torch.ones(N, K // 64),
        "zeros": torch.zeros(N, K // 64),
        "group_size": 64,
    }
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        int4_weight_only_matmul(**args)
