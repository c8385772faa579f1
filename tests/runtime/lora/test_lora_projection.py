"""One adapted projection's hook (LoRAProjection) in its C++ form against its torch-ops form, in bf16 at prefill
size: runs of one adapter long enough for the AMX tiles take them over the slots' packed panels, which a slot load
packs (and a clear zeroes) with the slot; on a CPU whose bf16 linears do not run AMX tiles nothing is packed and
the vector tiles run. Both forms are the runtime's; the kernel's paths are checked against float64 in
tests/kernels/test_cpu_lora.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpi_kernels.cpu import bf16_tile, cpu_kernels_available
from hpi_runtime.lora.layers import LoRABatch, LoRAProjection, PartSlice, ProjectionShape
from hpi_runtime.models.parallel import Span

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels do not build here")

# SmolLM2-135M's qkv: q 576 rows, k and v 192 each, from 576 inputs
SHAPE = ProjectionShape((PartSlice("q", 0, Span(0, 576)), PartSlice("k", 576, Span(0, 192)),
                         PartSlice("v", 768, Span(0, 192))), None, 576, 960)  # fmt: skip


def _load(projection: LoRAProjection, slot: int, generator: torch.Generator, rank: int = 8) -> None:
    a_slot, bt_slot = projection.host_zeros()
    for part in projection.parts:
        a = torch.randn(rank, SHAPE.in_features, generator=generator) * 0.1
        b = torch.randn(part.rows.size, rank, generator=generator) * 0.1
        projection.lay_out_part(a_slot, bt_slot, part.name, a, b, scaling=2.0)
    projection.copy_in(slot, a_slot, bt_slot)


def _delta(projection: LoRAProjection, mode: str, x: torch.Tensor, token_slots: np.ndarray) -> torch.Tensor:
    projection.batch.mode = mode
    projection.batch.set_step(token_slots, torch.device("cpu"), len(token_slots))
    return projection(None, (x,), torch.zeros(x.shape[0], SHAPE.out_features, dtype=torch.bfloat16))


def test_prefill_runs_in_the_cpu_form_match_the_torch_form() -> None:
    generator = torch.Generator().manual_seed(0)
    batch = LoRABatch(3, torch.zeros(0, dtype=torch.bfloat16), "cpu")
    projection = LoRAProjection(SHAPE, num_slots=3, max_rank=16, batch=batch)
    assert projection.amx is not None and (projection.amx.shape[1] > 0) == (bf16_tile() == "amx")
    for slot in range(3):
        _load(projection, slot, generator)
    # A prompt of 40 tokens of slot 0, one of 24 of the base model, 6 of slot 2, 30 of slot 1.
    token_slots = np.array([0] * 40 + [-1] * 24 + [2] * 6 + [1] * 30, dtype=np.int64)
    x = torch.randn(len(token_slots), SHAPE.in_features, generator=generator).bfloat16()
    torch.testing.assert_close(_delta(projection, "cpu", x, token_slots), _delta(projection, "torch", x, token_slots),
                               atol=2e-2, rtol=1e-2)  # fmt: skip
    # Slot 0 loaded with another adapter, slot 1 cleared: the panels follow the slots.
    _load(projection, 0, generator)
    projection.clear(1)
    got = _delta(projection, "cpu", x, token_slots)
    torch.testing.assert_close(got, _delta(projection, "torch", x, token_slots), atol=2e-2, rtol=1e-2)
    assert torch.equal(got[70:], torch.zeros_like(got[70:]))  # the cleared slot adds nothing
