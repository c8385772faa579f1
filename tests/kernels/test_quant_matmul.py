"""Weight-only INT8/INT4 matmul kernels against dequantize-then-matmul."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import int4_weight_only_matmul, int8_weight_only_matmul
from hpi_kernels.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from hpi_kernels.quant_matmul import (
    DEQUANT_MIN_ROWS,
    MatmulConfig,
    default_config,
    dequantized_int4,
    dequantized_int8,
)
from hpi_kernels.reference import int4_weight_only_matmul_ref, int8_weight_only_matmul_ref

N, K = 40, 256  # N not a multiple of the N tile: masked edge columns

SHAPES = [
    # (M, dtype, non_contiguous): M=1 to 70 take the kernels' tiles, 130 the dequantized copy and torch.matmul.
    pytest.param(1, torch.float32, False, id="m1-fp32"),
    pytest.param(5, torch.float16, True, id="m5-fp16-noncontig"),
    pytest.param(70, torch.float16, False, id="m70-fp16"),
    pytest.param(20, torch.float32, True, id="m20-fp32-noncontig"),
    pytest.param(3, torch.bfloat16, False, id="m3-bf16"),  # upcast after load in the interpreter
    pytest.param(DEQUANT_MIN_ROWS, torch.float32, True, id="dequant-rows-fp32-noncontig"),
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


# Tiles the defaults may not pick here, each with the K split: K tiles spanning several int4 groups, a last K tile
# half outside K (K = 96), a split whose programs get no K at all (4 tiles over 3 programs) and one that does not
# divide the tiles, and the K split at prefill-sized rows.
CONFIGS = [
    pytest.param(MatmulConfig(16, 32, 64, split_k=3), 256, 1, id="split3-k256"),
    pytest.param(MatmulConfig(16, 64, 128, split_k=2), 96, 5, id="split2-k96-tail"),
    pytest.param(MatmulConfig(32, 32, 64, split_k=5, num_stages=2), 256, 20, id="split5-empty-programs"),
    pytest.param(MatmulConfig(64, 32, 32, split_k=4), 256, 70, id="split4-m70"),
]


@pytest.mark.parametrize("config,k,m", CONFIGS)
def test_int8_and_int4_matmul_with_any_tiles_and_split_k(device, config, k, m) -> None:
    torch.manual_seed(1)
    weight = torch.randn(N, k).to(device)
    x = torch.randn(m, k).to(device)
    q8, s8 = quantize_int8(weight)
    out8 = int8_weight_only_matmul(x, q8, s8, config=config)
    torch.testing.assert_close(out8, int8_weight_only_matmul_ref(x, q8, s8), **_tol(x.dtype))
    packed, scales, zeros = quantize_int4(weight, 32)
    out4 = int4_weight_only_matmul(x, packed, scales, zeros, 32, config=config)
    torch.testing.assert_close(out4, int4_weight_only_matmul_ref(x, packed, scales, zeros, 32), **_tol(x.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 128])
def test_dequantized_copies_equal_the_reference_rounded_to_the_dtype(device, dtype, group_size) -> None:
    torch.manual_seed(2)
    weight = torch.randn(N, K).to(device)
    # Exact in fp32; in bf16 within one rounding step (Triton's interpreter rounds toward zero, a GPU to nearest).
    tol = {"atol": 0.0, "rtol": 0.0} if dtype == torch.float32 else {"atol": 0.0, "rtol": 2**-7}
    q8, s8 = quantize_int8(weight)
    torch.testing.assert_close(dequantized_int8(q8, s8, dtype), dequantize_int8(q8, s8).to(dtype), **tol)
    packed, scales, zeros = quantize_int4(weight, group_size)
    expected = dequantize_int4(packed, scales, zeros, group_size).to(dtype)
    torch.testing.assert_close(dequantized_int4(packed, scales, zeros, group_size, dtype), expected, **tol)


def test_default_tiles_split_k_for_decode_and_not_for_few_k_tiles() -> None:
    # An 8B model's o projection at one row: 64 column tiles would leave most of a GPU's SMs idle.
    decode = default_config(1, 4096, 4096, torch.bfloat16)
    assert decode.split_k > 1 and decode.block_m == 16
    assert 4096 // (decode.block_k * decode.split_k) >= 4  # every program still streams several K tiles
    assert default_config(1, 40, 256, torch.bfloat16).split_k == 1
    assert default_config(DEQUANT_MIN_ROWS - 1, 4096, 4096, torch.float32).block_k == 64


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
