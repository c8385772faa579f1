"""The C++ packed linears (hpi_kernels.cpu.packed_linear), fp32 and bf16, against F.linear over the unpacked
weight.

Row counts cover each path of the kernel: one register tile (1-12 rows), several tiles (13-320, in one or
two chunks of rows), and the prefill path that unpacks the weight for MKL (over 320; bf16 widened to fp32; a
weight too large to unpack stays on the packed kernel). Shapes cover a last panel that is partly padding and
in_features that are no multiple of the vector width (and, in bf16, odd: a last pair half padding). bf16 runs
each tile: widen, dpbf16 (AVX512-BF16) and amx (AMX-BF16: rows in blocks of 16, a last partial block padded, chunks
of 256 rows; in_features that are no multiple of 32 take the vector tile there).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hpi_kernels.cpu import (
    bf16_tile,
    cpu_capability,
    load_extension,
    pack_linear_weight,
    packed_linear,
    packed_logits,
    packed_weight_rows,
    prefill_gemm,
)

TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}  # fp32, sums of up to 1000 products in another order than MKL's


@pytest.fixture(scope="module", autouse=True)
def extension() -> str:
    return load_extension()


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40, 320, 321, 700])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (50, 40), (17, 600), (200, 1001)])
def test_matches_f_linear(rows: int, out_features: int, in_features: int) -> None:
    weight = _weight(out_features, in_features)
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features)
    packed = pack_linear_weight(weight)
    torch.testing.assert_close(packed_linear(x, packed, out_features), F.linear(x, weight), **TOLERANCE)
    torch.testing.assert_close(packed_linear(x, packed, out_features, bias), F.linear(x, weight, bias), **TOLERANCE)


@pytest.mark.parametrize("rows", [1, 13, 320, 321, 700])
def test_residual_is_added(rows: int) -> None:
    """fp32: a decoder layer's residual stream joins the output (in the GEMM on the prefill path, after the
    tiles below it), with and without a bias, over any leading shape."""
    weight, bias = _weight(96, 64), torch.randn(96)
    x, residual = torch.randn(rows, 64), torch.randn(rows, 96)
    packed = pack_linear_weight(weight)
    torch.testing.assert_close(packed_linear(x, packed, 96, residual=residual), residual + F.linear(x, weight),
                               **TOLERANCE)  # fmt: skip
    torch.testing.assert_close(packed_linear(x, packed, 96, bias, residual), residual + F.linear(x, weight, bias),
                               **TOLERANCE)  # fmt: skip
    assert torch.equal(packed_linear(x.view(1, rows, 64), packed, 96, residual=residual.view(1, rows, 96)),
                       packed_linear(x, packed, 96, residual=residual).view(1, rows, 96))  # fmt: skip


def test_weight_too_large_to_unpack_stays_on_the_packed_kernel() -> None:
    """Over 2**24 floats (a vocabulary's LM head: prompt logprobs over a long prompt) the prefill path would
    need a scratch copy as large as the weight; these rows run the packed kernel instead, and agree."""
    weight, x = _weight(4097, 4100), torch.randn(321, 4100)
    assert weight.numel() > 2**24
    # 4100-term sums of magnitude ~64: fp32 summation order alone differs by a few 1e-4
    torch.testing.assert_close(packed_linear(x, pack_linear_weight(weight), 4097), F.linear(x, weight),
                               atol=2e-3, rtol=1e-4)


def test_packed_layout_pads_the_last_panel_with_zeros() -> None:
    weight = _weight(50, 40)
    packed = pack_linear_weight(weight.t().contiguous().t())  # a column-major weight packs the same
    panel = packed.shape[2]
    assert packed.shape == (-(-50 // panel), 40, panel) and packed.is_contiguous()
    assert torch.equal(packed, pack_linear_weight(weight))
    columns = packed.permute(1, 0, 2).reshape(40, -1)  # [in, panels * panel]: weight.T, then padding
    assert torch.equal(columns[:, :50], weight.t())
    assert not columns[:, 50:].any()


def test_any_leading_shape_and_strided_rows() -> None:
    weight = _weight(64, 48)
    packed = pack_linear_weight(weight)
    x = torch.randn(3, 5, 48)
    out = packed_linear(x, packed, 64)
    assert out.shape == (3, 5, 64)
    torch.testing.assert_close(out, F.linear(x, weight), **TOLERANCE)
    wide = torch.randn(9, 100)  # rows of a wider tensor (a fused projection's slice): row stride 100, not 48
    torch.testing.assert_close(packed_linear(wide[:, 20:68], packed, 64), F.linear(wide[:, 20:68], weight), **TOLERANCE)
    columns = torch.randn(48, 7).t()  # not row-major at all
    torch.testing.assert_close(packed_linear(columns, packed, 64), F.linear(columns, weight), **TOLERANCE)
    assert packed_linear(torch.empty(0, 48), packed, 64).shape == (0, 64)


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    """Up to the prefill path, each row is summed in the same order whatever the other rows: a request's
    greedy tokens do not change with what it is batched with."""
    weight, x = _weight(96, 576), torch.randn(64, 576)
    packed = pack_linear_weight(weight)
    alone = torch.cat([packed_linear(x[i : i + 1], packed, 96) for i in range(64)])
    assert torch.equal(packed_linear(x, packed, 96), alone)
    assert torch.equal(packed_linear(x[5:30], packed, 96), alone[5:30])


def test_weight_rows_read_from_the_panels() -> None:
    weight = _weight(50, 40)
    ids = torch.tensor([[0, 49, 31], [32, 7, 7]])
    assert torch.equal(packed_weight_rows(pack_linear_weight(weight), ids, 40), F.embedding(ids, weight))


def test_bad_arguments_raise_value_error() -> None:
    weight = _weight(64, 48)
    packed = pack_linear_weight(weight)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU weight"):
        pack_linear_weight(weight.half())
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU weight"):
        pack_linear_weight(weight[0])
    with pytest.raises(ValueError, match="x has 47 features"):
        packed_linear(torch.randn(2, 47), packed, 64)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU x"):
        packed_linear(torch.randn(2, 48, dtype=torch.float16), packed, 64)
    with pytest.raises(ValueError, match="x is BFloat16, the weight Float"):  # bf16 x, fp32 panels
        packed_linear(torch.randn(2, 48, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(ValueError, match="does not fit a packed weight"):
        packed_linear(torch.randn(2, 48), packed, 65 + packed.shape[2])
    with pytest.raises(ValueError, match="from pack_linear_weight"):
        packed_linear(torch.randn(2, 48), weight, 64)  # an unpacked weight
    with pytest.raises(ValueError, match="bias must be Float"):
        packed_linear(torch.randn(2, 48), packed, 64, torch.randn(63))
    with pytest.raises(ValueError, match="bias must be BFloat16"):
        packed_linear(torch.randn(2, 48).bfloat16(), pack_linear_weight(weight.bfloat16()), 64, torch.randn(64))
    with pytest.raises(ValueError, match="residual must be Float"):
        packed_linear(torch.randn(2, 48), packed, 64, residual=torch.randn(2, 63))
    with pytest.raises(ValueError, match="residual must be BFloat16"):
        packed_linear(torch.randn(2, 48).bfloat16(), pack_linear_weight(weight.bfloat16()), 64,
                      residual=torch.randn(2, 64))  # fmt: skip


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40, 320, 321, 700])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (50, 41), (17, 600), (200, 1001)])
def test_fp32_x_over_bf16_panels_computes_what_fp32_panels_do(rows: int, out_features: int, in_features: int) -> None:
    """An fp32 model whose weights are bf16 values keeps them packed as bf16 (half the bytes): the widen tile
    multiplies the same values and sums them in the same k order as the fp32 tile, and prefill-sized x unpacks
    them to the same fp32 matrix for MKL, so every path gives the fp32 panels' result bit for bit."""
    weight = _weight(out_features, in_features).bfloat16()
    bias, x = torch.randn(out_features), torch.randn(rows, in_features)
    as_bf16, as_fp32 = pack_linear_weight(weight), pack_linear_weight(weight.float())
    assert as_bf16.dtype == torch.bfloat16 and as_bf16.element_size() * as_bf16.numel() < as_fp32.numel() * 4
    for b in (None, bias):
        out = packed_linear(x, as_bf16, out_features, b)
        assert out.dtype == torch.float32
        assert torch.equal(out, packed_linear(x, as_fp32, out_features, b))
        torch.testing.assert_close(out, F.linear(x, weight.float(), b), **TOLERANCE)
    assert torch.equal(packed_logits(x, as_bf16, out_features), packed_logits(x, as_fp32, out_features))
    strided = torch.randn(rows, in_features + 3)[:, :in_features]  # rows of x a stride apart, not contiguous
    assert torch.equal(packed_linear(strided, as_bf16, out_features), packed_linear(strided, as_fp32, out_features))


def test_op_schema_and_fake_kernel() -> None:
    # The fake kernel is what lets torch.compile keep the op opaque, with a symbolic row count.
    packed, op = pack_linear_weight(_weight(64, 48)), torch.ops.hpi_kernels.packed_linear.default
    torch.library.opcheck(op, (torch.randn(5, 48), packed, 64, None))
    torch.library.opcheck(op, (torch.randn(2, 3, 48), packed, 64, torch.randn(64)))
    bf16 = pack_linear_weight(_weight(64, 47).bfloat16())
    torch.library.opcheck(op, (torch.randn(5, 47, dtype=torch.bfloat16), bf16, 64, None))
    torch.library.opcheck(op, (torch.randn(2, 3, 47, dtype=torch.bfloat16), bf16, 64, torch.randn(64).bfloat16()))
    torch.library.opcheck(op, (torch.randn(2, 3, 47), bf16, 64, torch.randn(64)))  # fp32 x over bf16 panels
    torch.library.opcheck(op, (torch.randn(5, 48), packed, 64, None, torch.randn(5, 64)))  # with a residual
    torch.library.opcheck(op, (torch.randn(400, 47, dtype=torch.bfloat16), bf16, 64, torch.randn(64).bfloat16(),
                               torch.randn(400, 64, dtype=torch.bfloat16)))  # fmt: skip


# bf16: the kernel sums in fp32 and rounds once, so it agrees with the fp32 sum over the same bf16 values,
# rounded to bf16, to one bf16 step (the two fp32 sums differ in order only, which can tip a rounding).
BF16_STEP = {"atol": 1e-3, "rtol": 2**-7}


def _bf16_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).bfloat16()


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40, 257, 320, 321, 700])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (50, 41), (17, 600), (200, 1001), (40, 1536)])
def test_bf16_matches_the_fp32_sum_rounded_once(forced_packed_bf16_tile: str, rows: int, out_features: int,
                                                in_features: int) -> None:  # fmt: skip
    weight = _weight(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    packed = pack_linear_weight(weight)
    out = packed_linear(x, packed, out_features)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out, _bf16_reference(x, weight), **BF16_STEP)
    torch.testing.assert_close(packed_linear(x, packed, out_features, bias), _bf16_reference(x, weight, bias),
                               **BF16_STEP)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 13, 321])
def test_bf16_logits_are_the_fp32_sums_unrounded(forced_packed_bf16_tile: str, rows: int) -> None:
    """packed_logits (an LM head): the same fp32 sums as packed_linear, not rounded to bf16."""
    weight, x = _weight(200, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
    packed = pack_linear_weight(weight)
    logits = packed_logits(x, packed, 200)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 200)
    torch.testing.assert_close(logits, F.linear(x.double(), weight.double()).float(), atol=1e-4, rtol=1e-5)
    assert not torch.equal(logits, logits.bfloat16().float())  # finer than bf16's steps
    assert torch.equal(logits.bfloat16(), packed_linear(x, packed, 200)) or rows > 320  # same sums, one rounding
    fp32 = pack_linear_weight(weight.float())
    assert torch.equal(packed_logits(x.float(), fp32, 200), packed_linear(x.float(), fp32, 200))
    torch.library.opcheck(torch.ops.hpi_kernels.packed_logits.default, (x, packed, 200))


def test_bf16_weight_too_large_to_unpack_stays_on_the_packed_kernel(forced_packed_bf16_tile: str) -> None:
    weight, x = _weight(4097, 4100).bfloat16(), torch.randn(321, 4100).bfloat16()
    assert weight.numel() > 2**24
    torch.testing.assert_close(packed_linear(x, pack_linear_weight(weight), 4097), _bf16_reference(x, weight),
                               atol=2e-2, rtol=2**-7)  # fmt: skip  (4100-term sums of magnitude ~64)


def test_bf16_packed_layout_holds_pairs_of_k() -> None:
    weight = _weight(50, 41).bfloat16()
    packed = pack_linear_weight(weight.t().contiguous().t())  # a column-major weight packs the same
    panel = packed.shape[2]
    assert packed.shape == (-(-50 // panel), 21, panel, 2) and packed.is_contiguous()
    assert torch.equal(packed, pack_linear_weight(weight))
    rows = packed.permute(1, 3, 0, 2).reshape(42, -1)  # [k pairs * 2, panels * panel]: weight.T, then padding
    assert torch.equal(rows[:41, :50], weight.t())
    assert not rows[41:].any() and not rows[:, 50:].any()
    ids = torch.tensor([[0, 49, 31], [32, 7, 7]])
    assert torch.equal(packed_weight_rows(packed, ids, 41), F.embedding(ids, weight))


@pytest.mark.parametrize("rows", [321, 700])
def test_bf16_prefill_matches_with_either_gemm(forced_prefill_gemm: str, rows: int) -> None:
    for out_features, in_features in [(96, 64), (50, 41), (200, 1001)]:
        weight, bias = _weight(out_features, in_features).bfloat16(), torch.randn(out_features).bfloat16()
        x = torch.randn(rows, in_features).bfloat16()
        packed = pack_linear_weight(weight)
        torch.testing.assert_close(packed_linear(x, packed, out_features), _bf16_reference(x, weight), **BF16_STEP)
        torch.testing.assert_close(packed_linear(x, packed, out_features, bias), _bf16_reference(x, weight, bias),
                                   atol=2e-2, rtol=2**-7)  # fmt: skip  # oneDNN may add the bias after rounding
    assert prefill_gemm() == forced_prefill_gemm


@pytest.mark.parametrize("rows", [1, 13, 320, 321, 700])
def test_bf16_residual_is_added(forced_packed_bf16_tile: str, forced_prefill_gemm: str, rows: int) -> None:
    """bf16, every tile and both prefill GEMMs: output + residual within two bf16 roundings of the exact sum, at
    the scale of its terms (|residual| + |bias| + |x W^T|): the tiles round the product plus the bias, then the
    sum; the prefill GEMMs round the residual plus the bias, then the sum (once without a bias). The result itself
    may be far smaller than the terms."""
    weight, bias = _weight(96, 64).bfloat16(), torch.randn(96).bfloat16()
    x, residual = torch.randn(rows, 64).bfloat16(), (4 * torch.randn(rows, 96)).bfloat16()
    packed = pack_linear_weight(weight)
    product = F.linear(x.double(), weight.double())
    got = packed_linear(x, packed, 96, bias, residual)
    assert got.dtype == torch.bfloat16
    error = (got.double() - (residual.double() + bias.double() + product)).abs()
    scale = residual.double().abs() + bias.double().abs() + product.abs()
    assert (error <= 2**-7 * scale + 1e-3).all(), (error - 2**-7 * scale).max()
    without_residual = packed_linear(x, packed, 96, bias)
    assert not torch.equal(got, without_residual)


def test_the_tiles_differ_in_summation_order_only(forced_packed_bf16_tile: str) -> None:
    """Each tile's fp32 sums (the logits, unrounded) against fp64, and the two tiles against each other where both
    run: products are exact in both, so only the order of the fp32 additions differs."""
    weight, x = _weight(200, 576).bfloat16(), torch.randn(7, 576).bfloat16()
    packed = pack_linear_weight(weight)
    logits = packed_logits(x, packed, 200)
    exact = F.linear(x.double(), weight.double())
    torch.testing.assert_close(logits.double(), exact, atol=1e-4, rtol=1e-5)
    assert bf16_tile() == forced_packed_bf16_tile
    for other in {"widen", "dpbf16", "amx"} - {forced_packed_bf16_tile}:
        try:
            bf16_tile(other)
        except ValueError:
            continue  # this CPU lacks it
        torch.testing.assert_close(packed_logits(x, packed, 200), logits, atol=1e-4, rtol=1e-5)
    bf16_tile(forced_packed_bf16_tile)


def test_bf16_tile_choice_is_checked() -> None:
    assert bf16_tile() in ("widen", "dpbf16", "amx")
    with pytest.raises(ValueError, match="auto, widen, dpbf16 or amx"):
        bf16_tile("fp8")


def test_prefill_gemm_choice_is_checked() -> None:
    assert prefill_gemm() in ("bf16", "fp32")
    with pytest.raises(ValueError, match="auto, bf16 or fp32"):
        prefill_gemm("fp16")


def test_bf16_rows_do_not_depend_on_the_batch(forced_packed_bf16_tile: str) -> None:
    """Up to the prefill path, each bf16 row alone, in a slice or among 300 rows (two chunks of rows) sums in
    the same order."""
    weight, x = _weight(96, 576).bfloat16(), torch.randn(300, 576).bfloat16()
    packed = pack_linear_weight(weight)
    alone = torch.cat([packed_linear(x[i : i + 1], packed, 96) for i in range(0, 300, 25)])
    assert torch.equal(packed_linear(x, packed, 96)[::25], alone)
    assert torch.equal(packed_linear(x[5:30], packed, 96), packed_linear(x, packed, 96)[5:30])
    wide = torch.randn(9, 700).bfloat16()  # strided rows, as from a fused projection's slice
    torch.testing.assert_close(packed_linear(wide[:, 20:596], packed, 96), _bf16_reference(wide[:, 20:596], weight),
                               **BF16_STEP)  # fmt: skip


def test_built_for_torch_capability() -> None:
    if expected := os.environ.get("HPI_EXPECT_CPU_CAPABILITY"):  # set for the child runs below
        assert cpu_capability() == expected
    vector_width = {"AVX512": 16, "AVX2": 8}.get(cpu_capability())
    if vector_width is not None:  # two vectors per panel row
        assert pack_linear_weight(_weight(8, 4)).shape[2] == 2 * vector_width
