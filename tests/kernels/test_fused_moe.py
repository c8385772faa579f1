"""Fused MoE kernel against the per-token reference; the block alignment it relies on."""

from __future__ import annotations

import pytest
import torch

from hpi_kernels import fused_experts
from hpi_kernels.fused_moe import moe_align_block_size
from hpi_kernels.reference import fused_experts_ref


def test_align_groups_slots_by_expert_in_padded_runs() -> None:
    topk_ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # slots 0..5
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts=4, block_m=4)
    num_slots = 6
    runs = sorted_ids.view(-1, 4)
    used = expert_ids >= 0
    assert expert_ids[used].tolist() == [0, 1, 2]  # expert 3 gets no block
    assert [sorted(r[r < num_slots].tolist()) for r in runs[used]] == [[1, 4], [3], [0, 2, 5]]
    assert (runs[~used] == num_slots).all()
    assert sorted_ids.numel() >= num_slots + 4 * 3  # the worst case, no host sync needed


def _routing(num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator):
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


CASES = [
    # (num_tokens, num_experts, top_k, hidden, intermediate, dtype): N and K off the tile sizes, one decode
    pytest.param(1, 4, 2, 32, 48, torch.float32, id="decode-fp32"),
    pytest.param(9, 4, 2, 40, 24, torch.float32, id="ragged-fp32"),
    pytest.param(20, 8, 3, 32, 32, torch.float16, id="top3-fp16"),
    pytest.param(6, 4, 1, 32, 16, torch.bfloat16, id="top1-bf16"),
]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden_size,intermediate,dtype", CASES)
def test_fused_moe_matches_reference(device, num_tokens, num_experts, top_k, hidden_size, intermediate, dtype):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(device, dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden_size, generator=generator) / 4).to(device, dtype)
    w2 = (torch.randn(num_experts, hidden_size, intermediate, generator=generator) / 4).to(device, dtype)
    weights, ids = _routing(num_tokens, num_experts, top_k, generator)
    out = fused_experts(hidden, w13, w2, weights.to(device), ids.to(device))
    assert out.shape == hidden.shape and out.dtype == dtype
    expected = fused_experts_ref(hidden, w13, w2, weights, ids)
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_fused_moe_reads_non_contiguous_hidden(device) -> None:
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(32, 5, generator=generator).to(device).T  # column-major [5, 32]
    w13 = torch.randn(4, 32, 32, generator=generator).to(device) / 4
    w2 = torch.randn(4, 32, 16, generator=generator).to(device) / 4
    weights, ids = _routing(5, 4, 2, generator)
    out = fused_experts(hidden, w13, w2, weights.to(device), ids.to(device))
    torch.testing.assert_close(out, fused_experts_ref(hidden, w13, w2, weights, ids), atol=1e-4, rtol=1e-4)


def test_fused_moe_rejects_mismatched_shapes(device) -> None:
    hidden = torch.randn(3, 32, device=device)
    w13 = torch.randn(4, 32, 32, device=device)
    with pytest.raises(ValueError, match=r"w2.shape\[2\] must equal half of w13's rows"):
        fused_experts(
            hidden, w13, torch.randn(4, 32, 8, device=device), torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int64)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])  # decode (block 16), small and large prefill (block 64)
def test_fused_moe_realistic_shapes_on_gpu(num_tokens, dtype) -> None:
    """Mixtral-like proportions (8 experts, top 2, I = 3.5 H) at hidden 1024, compiled for the real GPU:
    tl.dot's tile minimums, bf16 arithmetic and the larger tiles are only checked here."""
    generator = torch.Generator().manual_seed(2)
    num_experts, hidden_size, intermediate = 8, 1024, 3584
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to("cuda", dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden_size, generator=generator) / 32).to("cuda", dtype)
    w2 = (torch.randn(num_experts, hidden_size, intermediate, generator=generator) / 60).to("cuda", dtype)
    weights, ids = _routing(num_tokens, num_experts, 2, generator)
    out = fused_experts(hidden, w13, w2, weights.cuda(), ids.cuda())
    expected = fused_experts_ref(hidden[:32], w13, w2, weights[:32], ids[:32])  # the reference is per token: slow
    error = ((out[:32].float() - expected.float()).norm() / expected.float().norm()).item()
    assert error < 1e-2, error
