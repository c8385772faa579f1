"""The multi-LoRA kernels (shrink, then expand into the base output) against the float64 reference: mixed
adapters and base tokens in one batch, a slot with more tokens than one tile, every float dtype, a strided
output (a slice of a fused projection's), and an all-base batch that changes nothing."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import group_tokens, lora_add_
from hpi_kernels.lora import BLOCK_M
from hpi_kernels.reference import lora_delta_ref

NUM_SLOTS, WIDTH, K, N = 3, 24, 80, 96  # W: three parts of rank 8 (a fused qkv); K, N not multiples of the tiles
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-2, "rtol": 1e-2},
       torch.bfloat16: {"atol": 1e-1, "rtol": 2e-2}}  # fmt: skip


def _weights(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    a = (torch.randn(NUM_SLOTS, WIDTH, K) / K**0.5).to(device, dtype)
    b = (torch.randn(NUM_SLOTS, N, WIDTH) / WIDTH**0.5).to(device, dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_adapters_and_base_tokens_get_each_their_own_delta(device, dtype) -> None:
    # Slot 0 has more tokens than one tile; slot 1 none; base tokens in between.
    slots = torch.tensor([0, -1, 2, 0, -1, 0, 2] + [0] * BLOCK_M + [-1, 2])
    a, b = _weights(dtype, device)
    x = torch.randn(len(slots), K).to(device, dtype)
    base = torch.randn(len(slots), N).to(device, dtype)
    out = base.clone()
    groups = group_tokens(slots, device)
    assert groups.tile_len.sum().item() == int((slots != -1).sum())
    assert groups.num_tiles == 3  # slot 0: 1 + BLOCK_M + 2 tokens in two tiles; slot 2: one
    lora_add_(out, x, a, b, groups)
    expected = base.double() + lora_delta_ref(x, a, b, slots)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    assert torch.equal(out[slots == -1], base[slots == -1])  # base tokens untouched, bit for bit


def test_a_strided_output_slice_and_an_all_base_batch(device) -> None:
    a, b = _weights(torch.float32, device)
    slots = torch.tensor([1, 1, -1, 0])
    x = torch.randn(4, K, device=device)
    fused = torch.zeros(4, N + 32, device=device)
    out = fused[:, 16 : 16 + N]  # a part of a wider output, rows strided by N + 32
    lora_add_(out, x, a, b, group_tokens(slots, device))
    torch.testing.assert_close(fused[:, 16 : 16 + N].double(), lora_delta_ref(x, a, b, slots), atol=1e-4, rtol=1e-4)
    assert not fused[:, :16].any() and not fused[:, 16 + N :].any()
    untouched = torch.randn(4, N, device=device)
    before = untouched.clone()
    lora_add_(untouched, x, a, b, group_tokens(torch.full((4,), -1), device))
    assert torch.equal(untouched, before)


def test_bad_shapes_are_refused_with_the_name_of_the_argument(device) -> None:
    a, b = _weights(torch.float32, device)
    x, out = torch.randn(2, K, device=device), torch.zeros(2, N, device=device)
    groups = group_tokens(torch.tensor([0, 1]), device)
    with pytest.raises(ValueError, match=r"a.shape\[2\] must equal x's in features"):
        lora_add_(out, torch.randn(2, K + 1, device=device), a, b, groups)
    with pytest.raises(ValueError, match=r"b.shape\[2\] must equal a's rank width"):
        lora_add_(out, x, a, b[:, :, :-1], groups)
