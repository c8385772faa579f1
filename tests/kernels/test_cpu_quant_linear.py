"""The C++ int8 / int4 packed linears (hpi_kernels.cpu.quant_linear) against an fp64 reference: x times the
dequantized weight (hpi_kernels.quant's formats), summed in fp64.

Row counts cover each path: one register tile, several tiles (and, for int4, tiles of the per-group folded
sums), two chunks of rows, and the prefill path that dequantizes the weight for MKL (over 320 rows). Shapes
cover a last panel that is partly padding. fp32 and bf16 activations: bf16 runs each tile the CPU has, forced in
turn (forced_packed_bf16_tile): the fp32 tiles over x widened (as fp32 x runs), the vdpbf16ps tiles (AVX512-BF16)
and the AMX tiles over each panel dequantized to bf16 (AMX-BF16; one or two blocks of 16 rows dequantize a step
at a time, more blocks a whole panel). W4A8 and W8A8 (x quantized to int8 per row and group of k, summed in
exact integer arithmetic) against the fp64 reference over x quantized the same way. The AVX2 and generic builds run
this file again in child processes (the AVX2 build twice on a CPU with AVX-VNNI: with its AVX-VNNI tiles and
without).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hpi_kernels.cpu import (
    int4_a8_linear,
    int4_a8_max_rows,
    int4_a8_tile,
    int4_linear,
    int8_a8_linear,
    int8_a8_logits,
    int8_a8_max_rows,
    int8_a8_tile,
    int8_linear,
    int8_logits,
    int8_weight_rows,
    load_extension,
    pack_int4_weight,
    pack_int8_weight,
    prefill_gemm,
)
from hpi_kernels.cpu.quant_linear import A8_ROW_LADDER
from hpi_kernels.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

FP32 = {"atol": 1e-4, "rtol": 1e-5}  # fp32 sums of up to 576 products against fp64
BF16 = {"atol": 1e-3, "rtol": 2**-7}  # + one bf16 rounding of the output


@pytest.fixture(scope="module", autouse=True)
def extension():
    """The exact prefill path (fp32 sgemm over the dequantized weight) unless a test forces the other."""
    path = load_extension()
    previous = prefill_gemm()
    prefill_gemm("fp32")
    yield path
    prefill_gemm(previous)


def _int8(out_features: int, in_features: int, seed: int = 0):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    qweight, scales = quantize_int8(weight, torch.bfloat16)
    return (qweight, scales), dequantize_int8(qweight, scales).double()


def _int4(out_features: int, in_features: int, group_size: int, seed: int = 0):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    packed, scales, zeros = quantize_int4(weight, group_size, torch.bfloat16)
    return (packed, scales, zeros), dequantize_int4(packed, scales, zeros, group_size).double()


def _reference(x: torch.Tensor, dequantized: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = F.linear(x.double(), dequantized, None if bias is None else bias.double())
    return out.to(x.dtype)


def _check(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **(BF16 if out.dtype == torch.bfloat16 else FP32))


ROWS = [1, 2, 3, 4, 5, 12, 13, 40, 257, 321]
AMX_MIN_ROWS = 3  # kMinAmxRows in packed_linear_quant.cpp: fewer rows take the vector tiles on AMX CPUs too
SHAPES = [(96, 64), (50, 128), (17, 576)]
# in_features 40 is no whole AMX tile of k: under the amx tile it takes the vector tile.
INT8_SHAPES = [*SHAPES, (24, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("out_features", "in_features"), INT8_SHAPES)
def test_int8_matches_the_fp64_reference(forced_packed_bf16_tile: str, out_features: int, in_features: int,
                                         dtype: torch.dtype) -> None:  # fmt: skip
    (qweight, scales), dequantized = _int8(out_features, in_features)
    packed, packed_scales = pack_int8_weight(qweight, scales)
    bias = torch.randn(out_features).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        _check(int8_linear(x, packed, packed_scales, out_features), _reference(x, dequantized, None))
        _check(int8_linear(x, packed, packed_scales, out_features, bias), _reference(x, dequantized, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int8_logits_are_the_fp32_sums_unrounded(forced_packed_bf16_tile: str, out_features: int, in_features: int,
                                                 dtype: torch.dtype) -> None:  # fmt: skip
    """An int8 LM head's logits: fp32 out for bf16 x too, within fp32's tolerance of the fp64 reference (one
    bf16 rounding of the output would miss it), and the rows an embedding tied to it looks up."""
    (qweight, scales), dequantized = _int8(out_features, in_features)
    packed, packed_scales = pack_int8_weight(qweight, scales)
    for rows in ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        logits = int8_logits(x, packed, packed_scales, out_features)
        _check(logits, _reference(x.float(), dequantized, None))
    ids = torch.tensor([[0, out_features - 1], [out_features // 2, 0]])
    assert torch.equal(int8_weight_rows(packed, packed_scales, ids, dtype), dequantized[ids].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int4_matches_the_fp64_reference(forced_packed_bf16_tile: str, out_features: int, in_features: int,
                                         group_size: int, dtype: torch.dtype) -> None:  # fmt: skip
    """The AMX tile (bf16 x, from 3 rows) multiplies the dequantized weight rounded to bf16, as the prefill path's
    bf16 GEMM does: its reference is over that weight. One or two rows take the vector tiles, exact weights."""
    (qweight, scales, zeros), dequantized = _int4(out_features, in_features, group_size)
    packed, scales_zeros = pack_int4_weight(qweight, scales, zeros, group_size)
    bias = torch.randn(out_features).to(dtype)
    amx = forced_packed_bf16_tile == "amx" and dtype == torch.bfloat16 and in_features % 32 == 0
    for rows in ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        weight = dequantized.bfloat16().double() if amx and AMX_MIN_ROWS <= rows <= 320 else dequantized
        _check(int4_linear(x, packed, scales_zeros, group_size, out_features), _reference(x, weight, None))
        _check(int4_linear(x, packed, scales_zeros, group_size, out_features, bias),
               _reference(x, weight, bias))  # fmt: skip


def _int8_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W4A8's and W8A8's x as the kernels quantize it: per row and group, scale = max|x| / 127 and codes = round(x *
    (127 / max|x|)) in fp32, ties to even (torch.round); a group of zeros has codes and scale 0. Returns (codes,
    scales) as [M, K] (k's order) and [M, K / group_size]."""
    groups = x.float().reshape(x.shape[0], -1, group_size)
    amax = groups.abs().amax(-1, keepdim=True)
    # A true division: `127 / amax` would be amax.reciprocal() * 127 in torch, rounded differently.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    return torch.round(groups * inverse).reshape(x.shape), (amax / 127).squeeze(-1)


def _dequantized_x(x: torch.Tensor, group_size: int) -> torch.Tensor:  # [M, K] fp64: codes * their group's scale
    codes, x_scales = _int8_groups(x, group_size)
    return (codes.double().reshape(x.shape[0], -1, group_size) * x_scales.double()[..., None]).reshape(x.shape)


def _a8_reference(x: torch.Tensor, quantized, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """fp64: sum over groups of x_scale * codes . (q - 8) * scale, plus zero * the exact sum of x."""
    qweight, scales, zeros = quantized
    x_hat = _dequantized_x(x, group_size)
    zero_part = zeros.double().repeat_interleave(group_size, dim=1)
    weight = dequantize_int4(qweight, scales, zeros, group_size).double() - zero_part
    out = x_hat @ weight.T + x.double() @ zero_part.T
    return (out if bias is None else out + bias.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int4_a8_matches_the_fp64_reference_of_its_quantized_x(out_features: int, in_features: int, group_size: int,
                                                               dtype: torch.dtype) -> None:  # fmt: skip
    """W4A8 (the vpdpbusd tile on AVX512-VNNI CPUs; the AVX2 build's child runs take its AVX-VNNI tile where the CPU
    has it and its vpmaddubsw tile, the generic build's the portable one) is exactly the integer dot products of
    x's int8 codes: within fp32's tolerance of the fp64 reference over x quantized the same way, at every row count
    (prefill-sized x too)."""
    quantized, dequantized = _int4(out_features, in_features, group_size)
    packed, scales_zeros = pack_int4_weight(*quantized, group_size)
    bias = torch.randn(out_features).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        expected = _a8_reference(x, quantized, group_size, bias)
        _check(int4_a8_linear(x, packed, scales_zeros, group_size, out_features, bias), expected)
    x = torch.randn(7, in_features).to(dtype)
    _check(int4_a8_linear(x, packed, scales_zeros, group_size, out_features),
           _a8_reference(x, quantized, group_size, None))  # fmt: skip


def _check_a8(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """W8A8 against its fp64 reference, unrounded: the integer sums are exact, so only fp32's sum over the groups
    and the scales' products are off (2e-7 of the largest |output| seen, 1e-6 allowed), plus for bf16 out its one
    rounding (half a step: at most 2**-8 of the value)."""
    assert out.dtype == dtype and out.shape == expected.shape
    rtol = 2**-8 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=1e-6 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("out_features", "in_features"), INT8_SHAPES)
def test_int8_a8_matches_the_fp64_reference_of_its_quantized_x(out_features: int, in_features: int,
                                                               dtype: torch.dtype) -> None:  # fmt: skip
    """W8A8 (the vpdpbusd tile where int8_a8_tile() is "vnni"; the AVX2 build's child runs take its AVX-VNNI tile
    where the CPU has it, which regroups the panels by byte and word unpacks and keeps its columns in a permuted
    order until the end, and the portable one, as the generic build does) is exactly the integer dot products of
    x's int8 codes, per group of 32 k: within fp32's rounding of the fp64 reference over x quantized the same way, at
    every row count (partial tiles of 8 rows, two chunks, prefill-sized x too). K no multiple of 32 (40) is
    int8_linear's result, bit for bit."""
    (qweight, scales), dequantized = _int8(out_features, in_features)
    packed, packed_scales = pack_int8_weight(qweight, scales)
    bias = torch.randn(out_features).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        for b in (bias, None):
            out = int8_a8_linear(x, packed, packed_scales, out_features, b)
            if in_features % 32:
                assert torch.equal(out, int8_linear(x, packed, packed_scales, out_features, b)), rows
            else:
                _check_a8(out, _reference(_dequantized_x(x, 32), dequantized, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("out_features", "in_features"), INT8_SHAPES)
def test_int8_a8_logits_recompute_each_rows_leaders_from_float_x(out_features: int, in_features: int,
                                                                 dtype: torch.dtype) -> None:  # fmt: skip
    """An int8 LM head with x in int8: fp32 logits (for bf16 x too) within fp32's rounding of the fp64 reference
    over x quantized per group of 32 k; then in each row the `rescore` largest within one nat of its largest are
    the fp64 reference over x itself (to fp32's rounding) and every other logit is left as it was, bit for bit.
    More rows than max_rows, or K no multiple of 32 (40), give int8_logits' result whole."""
    (qweight, scales), dequantized = _int8(out_features, in_features)
    packed, packed_scales = pack_int8_weight(qweight, scales)
    for rows in ROWS:
        x = torch.randn(rows, in_features).to(dtype)
        approximate = int8_a8_logits(x, packed, packed_scales, out_features, rescore=0)
        if in_features % 32:
            assert torch.equal(approximate, int8_logits(x, packed, packed_scales, out_features)), rows
            continue
        _check_a8(approximate, _reference(_dequantized_x(x, 32), dequantized, None).double(), torch.float32)
        exact = x.double() @ dequantized.T
        rescore = min(5, out_features)
        logits = int8_a8_logits(x, packed, packed_scales, out_features, rescore=rescore)
        for row, (approx, out) in enumerate(zip(approximate, logits, strict=True)):
            top = approx.topk(rescore).indices
            leaders = top[approx[top] >= approx.max() - 1.0]
            assert len(leaders) >= 1
            torch.testing.assert_close(out[leaders].double(), exact[row, leaders], rtol=1e-6, atol=1e-6)
            others = torch.ones(out_features, dtype=torch.bool)
            others[leaders] = False
            assert torch.equal(out[others], approx[others]), row
        assert torch.equal(int8_a8_logits(x, packed, packed_scales, out_features, max_rows=rows - 1),
                           int8_logits(x, packed, packed_scales, out_features))  # fmt: skip


def test_int8_a8_logits_leave_greedy_choices_to_float_x() -> None:
    """Near-ties: 2,000 rows of x against 4,000 tokens whose logits are close together. x's rounding to int8 alone
    changes which token leads in some rows (the check that this test can fail); with the leaders recomputed the
    argmax is the fp64 reference's over x itself in every row."""
    (qweight, scales), dequantized = _int8(4000, 128, seed=3)
    packed, packed_scales = pack_int8_weight(qweight, scales)
    x = torch.randn(2000, 128, generator=torch.Generator().manual_seed(4))
    expected = (x.double() @ dequantized.T).argmax(-1)
    approximate = int8_a8_logits(x, packed, packed_scales, 4000, rescore=0).argmax(-1)
    assert (approximate != expected).sum() > 0
    assert torch.equal(int8_a8_logits(x, packed, packed_scales, 4000).argmax(-1), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_a8_sums_the_codes_exactly(dtype: torch.dtype) -> None:
    """Whole numbers whose groups each hold a 127 are x's own codes (x_scale 1): with unit channel scales the
    output is the integer product x @ q.T exactly, even at its extremes (weight codes -128 and 127 against x codes
    -127 and 127 over all 576 k, whose sums fp32 still holds exactly): the tiles' sign-bit flip of the weight and
    its correction by -128 * the sum of x's codes lose nothing."""
    generator = torch.Generator().manual_seed(0)
    qweight = torch.randint(-128, 128, (50, 576), dtype=torch.int8, generator=generator)
    qweight[0], qweight[1] = -128, 127
    packed, packed_scales = pack_int8_weight(qweight, torch.ones(50))
    for rows in (1, 5, 13, 321):
        x = torch.randint(-127, 128, (rows, 576), generator=generator).float()
        x[:, 1::32] = 127
        x[0] = -127
        expected = x.double() @ qweight.double().T
        assert expected[0, 0] == 576 * 127 * 128 and expected[0, 1] == -576 * 127 * 127
        assert torch.equal(int8_a8_linear(x.to(dtype), packed, packed_scales, 50), expected.to(dtype)), rows


def test_int8_a8_rounds_x_times_127_over_amax_half_to_even() -> None:
    """x's codes are round(x * inv) with inv = 127 / max|x| in fp32 (one product, which x / x_scale would round
    differently near halves), ties to even; a group of zeros has codes and scale 0. With the identity weight at
    unit scales each output is a code times its group's scale, one fp32 rounding: equal bit for bit."""
    identity = torch.eye(64, dtype=torch.int8)
    packed, packed_scales = pack_int8_weight(identity, torch.ones(64))
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5, -126.5, 3.0])  # amax 127: inv 1 exactly
    tie_row = torch.cat([ties, torch.zeros(54)])  # its second group all zeros
    halves = torch.tensor([-126.5, -100.5, -63.5, -31.5, -2.5, -0.5, 0.5, 1.5, 44.5, 125.5])
    groups = []
    for amax in (0.37, 1.0, 3.1, 17.25, 1e-3, 250.0):
        # x * inv (inv in fp32, as the kernel's) near a half, and one fp32 step of x either side of it
        centre = halves / torch.tensor(127.0).div(amax)
        steps = [centre, centre.nextafter(torch.tensor(0.0)), centre.nextafter(centre.sign() * torch.inf)]
        groups.append(torch.cat([torch.tensor([-amax, 0.0]), *steps]))
    x = torch.cat([tie_row[None], torch.cat(groups).reshape(-1, 64)])
    codes, x_scales = _int8_groups(x, 32)
    assert codes[0, :10].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 3] and x_scales[0].tolist() == [1, 0]
    divided = torch.round(x.reshape(len(x), -1, 32) / x_scales[..., None].clamp_min(1e-30)).reshape(x.shape)
    assert not torch.equal(divided, codes)  # the rows tell the one product from a division by the scale
    expected = codes * x_scales.repeat_interleave(32, dim=1)
    assert torch.equal(int8_a8_linear(x, packed, packed_scales, 64), expected)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a8_groups_of_tiny_values_count_as_zeros(method: str) -> None:
    """A group whose largest |x| is below 1e-36 (127 / max|x| would overflow fp32) counts as zeros: codes and scale
    0, in every build: a row of such values comes out within 1e-36 of the float op (int4's zero points still take
    the exact sum of x; an overflowing code sum once gave -4e-34 in every column), and beside a group of normal
    values it changes nothing (int8: bit for bit; int4: its zero point's product with the tiny sum can break a
    rounding tie of the next FMA, one ulp)."""
    a8, plain = _a8_ops(method, 48, 64, None)
    x = torch.zeros(3, 64)
    x[:2, 0], x[:2, 1] = 1e-37, -5e-38
    x[1:, 32:] = torch.randn(32, generator=torch.Generator().manual_seed(3))
    out = a8(x)
    assert (out[0] - plain(x[:1])[0]).abs().max() < 1e-36
    assert out[2].abs().max() > 0
    torch.testing.assert_close(out[1], out[2], rtol=0 if method == "int8" else 2e-7, atol=0)


def _a8_ops(method: str, out_features: int, in_features: int, bias: torch.Tensor | None):
    """W4A8 (groups of 32: "int4") or W8A8 ("int8") over a random weight: (a8(x, max_rows=-1), the float op it
    falls back to)."""
    if method == "int4":
        quantized, _ = _int4(out_features, in_features, 32)
        packed4, scales_zeros = pack_int4_weight(*quantized, 32)
        return (lambda x, max_rows=-1: int4_a8_linear(x, packed4, scales_zeros, 32, out_features, bias, max_rows),
                lambda x: int4_linear(x, packed4, scales_zeros, 32, out_features, bias))  # fmt: skip
    packed, packed_scales = pack_int8_weight(*_int8(out_features, in_features)[0])
    return (lambda x, max_rows=-1: int8_a8_linear(x, packed, packed_scales, out_features, bias, max_rows),
            lambda x: int8_linear(x, packed, packed_scales, out_features, bias))  # fmt: skip


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a8_quantizes_each_group_apart(method: str) -> None:
    """Each group of k has its own scale: a 1000x outlier in group 0 leaves the other groups' result as it is
    without it (the output splits into the two parts exactly; there group 0 is all zeros), and the rounding of x
    costs under 1% elsewhere. Rows of zeros give the bias."""
    a8, plain = _a8_ops(method, 64, 128, None)
    x = torch.randn(3, 128)
    x[0, 3] = 1000.0
    first, rest = torch.zeros_like(x), x.clone()
    first[:, :32], rest[:, :32] = x[:, :32], 0
    torch.testing.assert_close(a8(x), a8(first) + a8(rest), atol=1e-3, rtol=1e-5)
    exact = plain(rest)
    assert 0 < (a8(rest) - exact).norm() < 0.01 * exact.norm()
    bias = torch.randn(64)
    with_bias, _ = _a8_ops(method, 64, 128, bias)  # the same weight
    assert torch.equal(with_bias(torch.zeros(3, 128)), bias.expand(3, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a8_up_to_max_rows_then_the_float_tiles(method: str, dtype: torch.dtype) -> None:
    """max_rows: inputs of at most that many rows (leading dimensions flattened) are W4A8's / W8A8's, bit for bit;
    larger ones int4_linear's / int8_linear's; 0 is never A8, -1 always."""
    a8, plain = _a8_ops(method, 96, 128, torch.randn(96).to(dtype))
    for rows in (1, 3, 4, 5, 8, 13, 16, 400):
        x = torch.randn(rows, 128).to(dtype)
        assert not torch.equal(a8(x), plain(x))  # the two paths differ, so the equalities below tell them apart
        assert torch.equal(a8(x, 4), a8(x) if rows <= 4 else plain(x)), rows
        assert torch.equal(a8(x, 13), a8(x) if rows <= 13 else plain(x)), rows
        assert torch.equal(a8(x, 0), plain(x))
    batched = torch.randn(2, 3, 128).to(dtype)  # 6 rows
    assert torch.equal(a8(batched, 5), plain(batched)) and torch.equal(a8(batched, 6), a8(batched))
    with pytest.raises(ValueError, match=f"{method}_a8_linear: max_rows must be -1"):
        a8(batched, -2)


@pytest.mark.parametrize(("method", "max_rows"), [("int4", int4_a8_max_rows), ("int8", int8_a8_max_rows)],
                         ids=["int4", "int8"])  # fmt: skip
def test_a8_max_rows_is_measured_once_or_set(method: str, max_rows, monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement returns -1, 0 or a count it timed, the same on a second call (cached per dtype); the
    environment variable replaces it, and a bad value is a ValueError."""
    variable = f"HPI_CPU_{method.upper()}_A8_MAX_ROWS"
    monkeypatch.delenv(variable, raising=False)
    max_rows.cache_clear()
    try:
        # A small shape, copied to stream 8 MiB: the default one walks the whole ladder in ~50 s where bf16 is
        # emulated (AVX2-only CPUs), and the runtime passes its model's shape anyway.
        measured = max_rows(torch.bfloat16, (96, 64))
        assert measured in (-1, 0, *A8_ROW_LADDER[:-1])
        assert max_rows(torch.bfloat16, (96, 64)) == measured and max_rows.cache_info().hits == 1  # not re-measured
        with pytest.raises(ValueError, match=f"{method}_a8_max_rows measures float32 or bfloat16"):
            max_rows(torch.float16)
        with pytest.raises(ValueError, match="K a multiple of 32"):
            max_rows(torch.bfloat16, (96, 48))
        for value in (12, -1, 0):
            max_rows.cache_clear()
            monkeypatch.setenv(variable, str(value))
            assert max_rows(torch.float32) == value
        for bad in ("many", "-2"):
            max_rows.cache_clear()
            monkeypatch.setenv(variable, bad)
            with pytest.raises(ValueError, match=f"{variable} must be -1"):
                max_rows(torch.float32)
    finally:
        max_rows.cache_clear()  # the next caller measures again, without the variable


def test_a8_tiles_name_this_cpus_path() -> None:
    capability = torch.backends.cpu.get_cpu_capability()  # the build in use (the child runs force AVX2, DEFAULT)
    flags = set(open("/proc/cpuinfo").read().split())
    # The AVX2 build's AVX-VNNI tiles, unless HPI_CPU_AVX_VNNI=0 (a child run keeps the vpmaddubsw / portable ones)
    avx_vnni = capability == "AVX2" and "avx_vnni" in flags and os.environ.get("HPI_CPU_AVX_VNNI") != "0"
    expected = {"AVX512": "vnni" if "avx512_vnni" in flags else "portable", "AVX2": "avx2"}.get(capability, "portable")
    assert int4_a8_tile() == ("avxvnni" if avx_vnni else expected)
    # W8A8 on AVX512-VNNI: vpermi2b (VBMI) regroups the panels, else (or with HPI_CPU_AVX512_VBMI=0) unpacks do
    vnni = capability == "AVX512" and "avx512_vnni" in flags
    vbmi = "avx512vbmi" in flags and os.environ.get("HPI_CPU_AVX512_VBMI") != "0"
    int8_tile = "vnni" if vnni and vbmi else "vnni_unpack" if vnni else "avxvnni" if avx_vnni else "portable"
    assert int8_a8_tile() == int8_tile


def test_bf16_prefill_with_either_gemm(forced_prefill_gemm: str) -> None:
    """Prefill-sized bf16 x over the dequantized weight, with each GEMM forced (both run on any machine): the
    bf16 GEMM reads the dequantized weight rounded to bf16, the fp32 one as it is."""
    (qweight, scales), dequantized8 = _int8(50, 128)
    (q4, s4, z4), dequantized4 = _int4(50, 128, 32)
    x, bias = torch.randn(400, 128).bfloat16(), torch.randn(50).bfloat16()
    for out, dequantized in [
        (int8_linear(x, *pack_int8_weight(qweight, scales), 50, bias), dequantized8),
        (int4_linear(x, *pack_int4_weight(q4, s4, z4, 32), 32, 50, bias), dequantized4),
    ]:
        weight = dequantized.bfloat16().double() if forced_prefill_gemm == "bf16" else dequantized
        torch.testing.assert_close(out, _reference(x, weight, None) + bias, atol=2e-2, rtol=2**-7)


def test_padding_columns_are_zero_and_layouts_follow_the_panel_width() -> None:
    (qweight, scales), _ = _int8(50, 64)
    packed, packed_scales = pack_int8_weight(qweight, scales)
    panel = packed.shape[2]
    assert packed.shape == (-(-50 // panel), 64, panel) and packed_scales.shape == (packed.shape[0] * panel,)
    columns = packed.permute(1, 0, 2).reshape(64, -1)  # [K, panels * panel]: the codes transposed, then zeros
    assert torch.equal(columns[:, :50], qweight.t()) and not columns[:, 50:].any()
    (q4, s4, z4), dequantized = _int4(50, 64, 32)
    packed4, scales_zeros = pack_int4_weight(q4, s4, z4, 32)
    assert packed4.shape == (packed.shape[0], 64 // 8, panel) and packed4.dtype == torch.int32
    assert scales_zeros.shape == (packed.shape[0], 2, panel, 2) and scales_zeros.dtype == torch.bfloat16
    out = int4_linear(torch.eye(64), packed4, scales_zeros, 32, 50)  # row k: the weight's column k
    torch.testing.assert_close(out, dequantized.t().float(), **FP32)


def test_any_leading_shape_strided_rows_and_no_rows() -> None:
    (qweight, scales), dequantized = _int8(64, 96)
    packed, packed_scales = pack_int8_weight(qweight, scales)
    (q4, s4, z4), dequantized4 = _int4(64, 96, 32)
    packed4, scales_zeros = pack_int4_weight(q4, s4, z4, 32)
    x = torch.randn(3, 5, 96)
    _check(int8_linear(x, packed, packed_scales, 64), _reference(x, dequantized, None))
    _check(int4_linear(x, packed4, scales_zeros, 32, 64), _reference(x, dequantized4, None))
    wide = torch.randn(9, 130)[:, 20:116]  # rows of a wider tensor: row stride 130
    _check(int8_linear(wide, packed, packed_scales, 64), _reference(wide, dequantized, None))
    _check(int4_linear(wide, packed4, scales_zeros, 32, 64), _reference(wide, dequantized4, None))
    assert int8_linear(torch.empty(0, 96), packed, packed_scales, 64).shape == (0, 64)
    assert int4_linear(torch.empty(0, 96), packed4, scales_zeros, 32, 64).shape == (0, 64)
    # W8A8 quantizes each row of x as it lies: leading dimensions and a row stride change nothing.
    flat = int8_a8_linear(x.reshape(15, 96), packed, packed_scales, 64)
    assert torch.equal(int8_a8_linear(x, packed, packed_scales, 64), flat.reshape(3, 5, 64))
    assert torch.equal(int8_a8_linear(wide, packed, packed_scales, 64),
                       int8_a8_linear(wide.contiguous(), packed, packed_scales, 64))  # fmt: skip
    assert int8_a8_linear(torch.empty(0, 96), packed, packed_scales, 64).shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_result_does_not_depend_on_the_batch(forced_packed_bf16_tile: str, dtype: torch.dtype) -> None:
    """Below the prefill path each row sums in the same order whatever the other rows: a request's greedy
    tokens do not change with what it is batched with. On AMX tiles from 3 rows up (fewer take the vector tiles,
    int8's result then differing by summation order only), so there a row is computed beside two others."""
    x = torch.randn(64, 128).to(dtype)
    others = x[:AMX_MIN_ROWS - 1] if forced_packed_bf16_tile == "amx" and dtype == torch.bfloat16 else x[:0]
    (qweight, scales), _ = _int8(96, 128)
    (q4, s4, z4), _ = _int4(96, 128, 32)
    ops = [lambda rows, p=pack_int8_weight(qweight, scales): int8_linear(rows, *p, 96),
           lambda rows, p=pack_int4_weight(q4, s4, z4, 32): int4_linear(rows, p[0], p[1], 32, 96),
           lambda rows, p=pack_int4_weight(q4, s4, z4, 32): int4_a8_linear(rows, p[0], p[1], 32, 96),
           lambda rows, p=pack_int8_weight(qweight, scales): int8_a8_linear(rows, *p, 96)]  # fmt: skip
    for op in ops:
        alone = torch.cat([op(torch.cat([x[i : i + 1], others]))[:1] for i in range(64)])
        assert torch.equal(op(x), alone)
        assert torch.equal(op(x[5:30]), alone[5:30])
    # W4A8 and W8A8 have no prefill path: a row in a 400-row prefill chunk is the row of a decode step.
    long = torch.cat([x, torch.randn(336, 128).to(dtype)])
    for a8 in ops[2:]:
        assert torch.equal(a8(long)[:64], a8(x))


def test_bad_arguments_raise_value_error() -> None:
    (qweight, scales), _ = _int8(64, 96)
    packed, packed_scales = pack_int8_weight(qweight, scales)
    (q4, s4, z4), _ = _int4(64, 96, 32)
    packed4, scales_zeros = pack_int4_weight(q4, s4, z4, 32)
    with pytest.raises(ValueError, match="int8 CPU codes"):
        pack_int8_weight(qweight.float(), scales)
    with pytest.raises(ValueError, match="scales must be float"):
        pack_int8_weight(qweight, scales[:5])
    with pytest.raises(ValueError, match="uint8 CPU codes"):
        pack_int4_weight(q4.to(torch.int8), s4, z4, 32)
    with pytest.raises(ValueError, match="group_size 12 must be a multiple of 8 that divides"):
        pack_int4_weight(q4, s4, z4, 12)
    with pytest.raises(ValueError, match="scales and zeros must be float"):
        pack_int4_weight(q4, s4, z4[:, :1], 32)
    with pytest.raises(ValueError, match="x has 95 features"):
        int8_linear(torch.randn(2, 95), packed, packed_scales, 64)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU x"):
        int4_linear(torch.randn(2, 96).half(), packed4, scales_zeros, 32, 64)
    with pytest.raises(ValueError, match="does not fit a packed weight"):
        int8_linear(torch.randn(2, 96), packed, packed_scales, 65 + packed.shape[2])
    with pytest.raises(ValueError, match="from its pack op"):
        int8_linear(torch.randn(2, 96), qweight, packed_scales, 64)  # codes never packed
    with pytest.raises(ValueError, match="scales_zeros must be the bfloat16"):
        int4_linear(torch.randn(2, 96), packed4, scales_zeros, 96, 64)  # another group size than packed
    with pytest.raises(ValueError, match="bias must be Float"):
        int4_linear(torch.randn(2, 96), packed4, scales_zeros, 32, 64, torch.randn(64).bfloat16())
    with pytest.raises(ValueError, match="int4_a8_linear: scales_zeros must be the bfloat16"):
        int4_a8_linear(torch.randn(2, 96), packed4, scales_zeros, 96, 64)
    with pytest.raises(ValueError, match="int4_a8_linear: x has 95 features"):
        int4_a8_linear(torch.randn(2, 95), packed4, scales_zeros, 32, 64)
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match="int8_a8_linear: x has 95 features"):
        int8_a8_linear(torch.randn(2, 95), packed, packed_scales, 64)
    with pytest.raises(ValueError, match="int8_a8_linear takes float32 or bfloat16 CPU x"):
        int8_a8_linear(x.half(), packed, packed_scales, 64)
    with pytest.raises(ValueError, match="int8_a8_linear: out_features 97 does not fit"):
        int8_a8_linear(x, packed, packed_scales, 97)
    with pytest.raises(ValueError, match="int8_a8_linear: the packed weight .* from its pack op"):
        int8_a8_linear(x, qweight, packed_scales, 64)
    with pytest.raises(ValueError, match="int8_a8_linear: scales must be the float32"):
        int8_a8_linear(x, packed, packed_scales[:5], 64)
    with pytest.raises(ValueError, match="int8_a8_linear's bias must be Float"):
        int8_a8_linear(x, packed, packed_scales, 64, torch.randn(64).bfloat16())
    with pytest.raises(ValueError, match="int8_a8_linear: max_rows must be -1"):
        int8_a8_linear(x, packed, packed_scales, 64, None, -2)
    with pytest.raises(ValueError, match=r"int8_a8_logits: rescore must be in \[0, 64\], got 65"):
        int8_a8_logits(x, packed, packed_scales, 64, rescore=65)
    with pytest.raises(ValueError, match="int8_a8_logits: x has 95 features"):
        int8_a8_logits(torch.randn(2, 95), packed, packed_scales, 64)
    (q40, s40), _ = _int8(64, 40)  # K no multiple of 32, which int8_linear's paths take: checked as int8_a8_linear
    with pytest.raises(ValueError, match="int8_a8_linear's bias must be Float"):
        int8_a8_linear(torch.randn(2, 40), *pack_int8_weight(q40, s40), 64, torch.randn(64).bfloat16())


def test_op_schemas_and_fake_kernels() -> None:
    # The fake kernels let torch.compile keep the ops opaque, with a symbolic row count.
    (qweight, scales), _ = _int8(64, 96)
    (q4, s4, z4), _ = _int4(64, 96, 32)
    packed, packed_scales = pack_int8_weight(qweight, scales)
    packed4, scales_zeros = pack_int4_weight(q4, s4, z4, 32)
    int8_op, int4_op = torch.ops.hpi_kernels.int8_linear.default, torch.ops.hpi_kernels.int4_linear.default
    torch.library.opcheck(int8_op, (torch.randn(5, 96), packed, packed_scales, 64, None))
    torch.library.opcheck(int8_op, (torch.randn(2, 3, 96).bfloat16(), packed, packed_scales, 64,
                                    torch.randn(64).bfloat16()))  # fmt: skip
    torch.library.opcheck(torch.ops.hpi_kernels.int8_logits.default,
                          (torch.randn(2, 3, 96).bfloat16(), packed, packed_scales, 64))  # fmt: skip
    torch.library.opcheck(int4_op, (torch.randn(5, 96), packed4, scales_zeros, 32, 64, torch.randn(64)))
    torch.library.opcheck(int4_op, (torch.randn(2, 3, 96).bfloat16(), packed4, scales_zeros, 32, 64, None))
    a8_op = torch.ops.hpi_kernels.int4_a8_linear.default
    torch.library.opcheck(a8_op, (torch.randn(5, 96), packed4, scales_zeros, 32, 64, torch.randn(64)))
    torch.library.opcheck(a8_op, (torch.randn(2, 3, 96).bfloat16(), packed4, scales_zeros, 32, 64, None))
    torch.library.opcheck(a8_op, (torch.randn(2, 3, 96).bfloat16(), packed4, scales_zeros, 32, 64, None, 4))
    w8a8_op = torch.ops.hpi_kernels.int8_a8_linear.default
    torch.library.opcheck(w8a8_op, (torch.randn(5, 96), packed, packed_scales, 64, torch.randn(64)))
    torch.library.opcheck(w8a8_op, (torch.randn(2, 3, 96).bfloat16(), packed, packed_scales, 64, None))
    torch.library.opcheck(w8a8_op, (torch.randn(2, 3, 96).bfloat16(), packed, packed_scales, 64, None, 4))
    (q40, s40), _ = _int8(64, 40)
    torch.library.opcheck(w8a8_op, (torch.randn(2, 3, 40), *pack_int8_weight(q40, s40), 64, None))
    logits_op = torch.ops.hpi_kernels.int8_a8_logits.default
    torch.library.opcheck(logits_op, (torch.randn(2, 3, 96).bfloat16(), packed, packed_scales, 64, -1, 4))
    torch.library.opcheck(logits_op, (torch.randn(5, 96), packed, packed_scales, 64, 2, 64))
