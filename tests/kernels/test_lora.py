"""Batched LoRA kernel (BGMV) against the token-by-token reference: tokens of several adapters and of none in
one launch, B read in place through the runtime's [N, S, W] layout, accumulation into the layer's output; bf16
adapters under fp32 activations (`--lora-dtype bfloat16`)."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import lora_bgmv, lora_delta
from hpi_kernels.reference import lora_bgmv_ref

CASES = [
    # (tokens, slots, N, K, dtype, the weights' dtype): N and K off the block sizes, one decode token
    pytest.param(1, 2, 24, 40, torch.float32, torch.float32, id="decode-fp32"),
    pytest.param(9, 4, 70, 48, torch.float32, torch.float32, id="mixed-fp32"),
    pytest.param(7, 3, 33, 64, torch.bfloat16, torch.bfloat16, id="mixed-bf16"),
    pytest.param(9, 4, 70, 48, torch.float32, torch.bfloat16, id="bf16-weights-fp32-x"),
]


@pytest.mark.parametrize("num_tokens,num_slots,n,k,dtype,weight_dtype", CASES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_bgmv_matches_reference(device, num_tokens, num_slots, n, k, dtype, weight_dtype, accumulate):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, k, generator=generator).to(device, dtype)
    weights = (torch.randn(num_slots, n, k, generator=generator) / 4).to(device, weight_dtype)
    slot_ids = torch.randint(-1, num_slots, (num_tokens,), generator=generator).to(device)
    out = torch.randn(num_tokens, n, generator=generator).to(device, dtype)
    # bf16 weights are exact in fp32: the reference takes the same values in x's dtype
    expected = lora_bgmv_ref(x.cpu(), weights.cpu().to(dtype), slot_ids.cpu(), out.cpu(), accumulate)
    lora_bgmv(x, weights, slot_ids, out, accumulate)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)


def test_delta_adds_each_tokens_adapter_in_place(device):
    generator = torch.Generator().manual_seed(1)
    num_slots, width, n, k = 3, 8, 36, 20
    x = torch.randn(6, k, generator=generator).to(device)
    a = torch.randn(num_slots, width, k, generator=generator).to(device)
    b = torch.randn(n, num_slots, width, generator=generator).to(device)  # the runtime's layout
    slot_ids = torch.tensor([2, -1, 0, 0, 1, -1], device=device)
    base = torch.randn(6, n, generator=generator).to(device)
    out = lora_delta(x, a, b, slot_ids, base.clone())
    for t, slot in enumerate(slot_ids.tolist()):
        delta = 0 if slot < 0 else b[:, slot] @ (a[slot] @ x[t])
        torch.testing.assert_close(out[t], base[t] + delta, atol=1e-4, rtol=1e-4)


def test_bgmv_rejects_mismatched_shapes(device):
    x = torch.randn(2, 16, device=device)
    with pytest.raises(ValueError, match=r"weights.shape\[2\] must equal x's K"):
        lora_bgmv(x, torch.randn(2, 8, 12, device=device), torch.zeros(2, dtype=torch.int64, device=device),
                  torch.empty(2, 8, device=device))  # fmt: skip
