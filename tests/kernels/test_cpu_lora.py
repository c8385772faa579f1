"""The C++ batched LoRA (hpi_kernels.cpu.lora_add) against the plain-PyTorch reference in float64: tokens of
several slots interleaved with base tokens (slot -1), slots with more tokens than one tile and none at all, sizes
that are no multiple of the vector width (the scalar tails), fp32, bf16 and bf16 slots under fp32 x (`--lora-dtype
bfloat16`), a prefill large enough to split over
threads; a fused projection's parts (q, k, v), whose Bt blocks alone are read; runs of one slot on the AMX tiles
(where the CPU has them) over the slots' packed panels; the in-place op writes only the adapted rows; and bad
inputs refused."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels.cpu import bf16_tile, load_extension, lora_add, lora_add_ref
from hpi_kernels.cpu.lora_delta import lora_pack_amx


@pytest.fixture(scope="module", autouse=True)
def extension() -> str:
    return load_extension()


@pytest.mark.parametrize(("dtype", "slot_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize(("tokens", "slots", "width", "in_features", "out_features", "part_cols"),
                         [(1, 1, 16, 64, 96, None), (13, 3, 48, 576, 960, [0, 576, 768, 960]),
                          (37, 4, 8, 70, 33, None), (9, 2, 6, 40, 77, [0, 13, 13, 77]),  # tails; an empty part
                          (11, 2, 5, 64, 80, None),  # an odd rank: bf16's paired expand has a half pair
                          (6, 2, 260, 32, 64, [0, 32, 64]),  # 130 ranks a part: above the paired expand's 128
                          # 512 tokens, 341 on slot 0: 43 tiles, more than one thread's share (kMinWorkPerThread)
                          (512, 3, 32, 256, 1024, [0, 512, 1024])])  # fmt: skip
def test_matches_the_float64_reference(forced_bf16_tile, dtype, slot_dtype, tokens, slots, width, in_features,
                                       out_features, part_cols) -> None:  # fmt: skip
    """Either bf16 tile (widened to fp32 FMAs, or vdpbf16ps for the shrink and the expand where the CPU has it),
    fp32's FMAs. Bt is random outside its parts' blocks too: the reference leaves that out, so the kernel must not
    read it. bf16 slots under fp32 x are exact to fp32's rounding: the reference takes the same bf16 values."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, in_features, generator=g).to(dtype)
    a = (torch.randn(slots, width, in_features, generator=g) * 0.1).to(slot_dtype)
    bt = (torch.randn(slots, width, out_features, generator=g) * 0.1).to(slot_dtype)
    out = torch.randn(tokens, out_features, generator=g).to(dtype)
    # Slot 0 gets most tokens (several tiles), the last slot none; every third token is the base model's.
    token_slots = torch.tensor([-1 if t % 3 == 2 else (0 if t % 2 else t % max(slots - 1, 1)) for t in range(tokens)])
    got = lora_add(x, a, bt, token_slots, out, part_cols)
    want = lora_add_ref(x.double(), a.double(), bt.double(), token_slots, out.double(), part_cols)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(got.double(), want, **tolerance)
    base = token_slots < 0
    assert torch.equal(got[base], out[base])  # base tokens untouched, bit for bit
    assert not torch.allclose(got[~base].double(), out[~base].double(), atol=1e-3)  # the delta is really there


# Runs of one slot: 40 tokens (a whole piece of 32 and 8 more), base tokens, 20 (one tile and a partial one), 8
# (below the AMX tiles' 16: the vector tiles), 27; slot 3 has no token.
RUNS = [(0, 40), (-1, 5), (2, 20), (1, 8), (0, 27)]


@pytest.mark.parametrize(("width", "in_features", "out_features", "part_cols"),
                         [(48, 576, 960, [0, 576, 768, 960]),  # SmolLM2's qkv: W 48 padded to 64
                          (15, 64, 77, [0, 13, 13, 77]),  # an odd rank a part, an empty part, a partial panel
                          (32, 1536, 576, None)])  # fmt: skip
def test_runs_of_one_slot_on_the_amx_panels(forced_packed_bf16_tile, width, in_features, out_features,
                                            part_cols) -> None:  # fmt: skip
    """With every tile: where it is amx, lora_pack_amx packs the slots and the runs of 16 tokens or more take the
    AMX tiles (the shrunk tokens rounded to bf16, the expand's sums over out's own values rounded once); with the
    vector tiles it packs nothing and lora_add keeps to them. Either way the float64 reference's result."""
    g = torch.Generator().manual_seed(width)
    tokens = sum(length for _, length in RUNS)
    x = torch.randn(tokens, in_features, generator=g).bfloat16()
    a = (torch.randn(4, width, in_features, generator=g) * 0.1).bfloat16()
    bt = (torch.randn(4, width, out_features, generator=g) * 0.1).bfloat16()
    out = torch.randn(tokens, out_features, generator=g).bfloat16()
    token_slots = torch.tensor([slot for slot, length in RUNS for _ in range(length)])
    packed = lora_pack_amx(a, bt, part_cols)
    assert packed.shape[0] == 4 and (packed.shape[1] > 0) == (forced_packed_bf16_tile == "amx")
    got = lora_add(x, a, bt, token_slots, out, part_cols, amx=packed)
    want = lora_add_ref(x.double(), a.double(), bt.double(), token_slots, out.double(), part_cols)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)
    base = token_slots < 0
    assert torch.equal(got[base], out[base])
    # The panels are of these slots' weights: a slot rewritten and packed again gives its new delta.
    a[2], bt[2] = -a[2], -bt[2]
    got = lora_add(x, a, bt, token_slots, out, part_cols, amx=lora_pack_amx(a, bt, part_cols))
    want = lora_add_ref(x.double(), a.double(), bt.double(), token_slots, out.double(), part_cols)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)


def test_amx_panels_are_packed_for_bf16_alone_and_checked() -> None:
    a, bt = torch.randn(2, 16, 64), torch.randn(2, 16, 40)
    assert lora_pack_amx(a, bt).shape == (2, 0)  # fp32 slots: the vector tiles
    if bf16_tile() != "amx":
        assert lora_pack_amx(a.bfloat16(), bt.bfloat16()).shape == (2, 0)
        return
    packed = lora_pack_amx(a.bfloat16(), bt.bfloat16())
    x, out = torch.randn(16, 64).bfloat16(), torch.randn(16, 40).bfloat16()
    with pytest.raises(ValueError, match="lora_pack_amx's panels"):
        lora_add(x, a.bfloat16(), bt.bfloat16(), torch.zeros(16, dtype=torch.int64), out, amx=packed[:, :-2])


def test_in_place_op_writes_only_the_adapted_rows() -> None:
    g = torch.Generator().manual_seed(0)
    x, a, bt = torch.randn(4, 16, generator=g), torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 24, generator=g)
    out = torch.randn(4, 24, generator=g)
    slots = torch.tensor([1, -1, 0, -1])
    want = lora_add_ref(x, a, bt, slots, out)
    before = out.clone()
    torch.ops.hpi_kernels.lora_add_(out, x, a, bt, slots, [0, 24])
    torch.testing.assert_close(out, want)
    assert torch.equal(out[[1, 3]], before[[1, 3]]) and not torch.equal(out[[0, 2]], before[[0, 2]])
    untouched = out.clone()
    torch.ops.hpi_kernels.lora_add_(out, x, a, bt, torch.full((4,), -1), [0, 24])  # no adapter: nothing written
    assert torch.equal(out, untouched)


def test_bad_inputs_are_refused() -> None:
    x, a, bt, out = torch.randn(2, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 6), torch.randn(2, 6)
    with pytest.raises(ValueError, match="slot 2"):
        lora_add(x, a, bt, torch.tensor([0, 2]), out)
    with pytest.raises(ValueError, match="out must be"):
        lora_add(x, a, bt, torch.tensor([0, 1]), torch.randn(2, 5))
    with pytest.raises(ValueError, match="share one dtype"):
        lora_add(x, a.double(), bt, torch.tensor([0, 1]), out)
    with pytest.raises(ValueError, match="share one dtype"):  # fp32 slots under bf16 x: not a combination it runs
        lora_add(x.bfloat16(), a, bt, torch.tensor([0, 1]), out.bfloat16())
    with pytest.raises(ValueError, match="share one dtype"):  # out must be x's
        lora_add(x, a.bfloat16(), bt.bfloat16(), torch.tensor([0, 1]), out.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.hpi_kernels.lora_add_(torch.randn(6, 2).t(), x, a, bt, torch.tensor([0, 1]), [0, 6])
    with pytest.raises(ValueError, match="part_cols"):  # 3 parts do not split W = 4 rows
        lora_add(x, a, bt, torch.tensor([0, 1]), out, [0, 2, 4, 6])
    with pytest.raises(ValueError, match="part_cols"):  # columns must end at N
        lora_add(x, a, bt, torch.tensor([0, 1]), out, [0, 3, 5])
