"""The scheduler under LoRA: at most max_loras distinct adapters per batch, every request completes (more
adapters than slots), adapters move into slots with the step that first needs them, and a request kept waiting
by the limit is admitted in bounded time even while another adapter's requests keep arriving."""

from __future__ import annotations

import pytest

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.scheduler import LORA_DRAIN_PATIENCE
from hpi_runtime.frontend.engine import LLMEngine
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.lora.slot_table import BASE_SLOT, LoRASlotTable
from hpi_runtime.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
LORAS = [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, 5)]


@pytest.fixture
def engine(fake_executor_cls) -> LLMEngine:
    config = EngineConfig(block_size=8, max_model_len=128, max_loras=2, max_cpu_loras=3)
    return LLMEngine(config, fake_executor_cls(64, config.block_size), None, frozenset())


def _slots_by_step(engine: LLMEngine) -> list[set[int]]:
    """Per step: the adapter slots of its scheduled requests (from the slot each was sent with)."""
    slot_of, found = {}, []
    for batch in engine.executor.batches:
        slot_of.update((new.request_id, new.lora_slot) for new in batch.new_requests)
        found.append({slot_of[r] for r in batch.num_scheduled_tokens} - {BASE_SLOT})
    return found


def test_more_adapters_than_slots_all_complete_within_the_limit(engine, drain, pool_invariants, expected_token):
    for i in range(12):
        lora = None if i % 5 == 4 else LORAS[i % 4]
        engine.add_request(f"r{i}", list(range(10 + i, 20 + i)), PARAMS, lora_request=lora)
    finals = drain(engine, pool_invariants)
    assert len(finals) == 12 and all(len(out.output_token_ids) == 6 for out in finals.values())
    assert all(len(slots) <= 2 for slots in _slots_by_step(engine))
    loads = [load for batch in engine.executor.batches for load in batch.lora_updates.loads]
    assert {load.lora.lora_name for load in loads} == {"a1", "a2", "a3", "a4"}
    assert all(0 <= load.slot < 2 for load in loads)
    evictions = [i for batch in engine.executor.batches for i in batch.lora_updates.host_evictions]
    stats = engine.get_stats()
    assert stats.lora_slot_loads == len(loads) and stats.lora_host_evictions == len(evictions) >= 1
    assert stats.lora_running == () and stats.lora_waiting == ()


def test_a_waiting_adapter_is_not_starved_by_a_busy_one(engine):
    # a1 and a2 hold both slots; a1's requests keep coming; a3 waits behind them.
    engine.add_request("a1-0", list(range(10)), PARAMS, lora_request=LORAS[0])
    engine.add_request("a2-0", list(range(10)), SamplingParams(max_tokens=40, ignore_eos=True),
                       lora_request=LORAS[1])  # fmt: skip
    engine.step()
    engine.add_request("a3-0", list(range(10)), PARAMS, lora_request=LORAS[2])
    admitted_at = None
    for step in range(60):
        engine.add_request(f"a1-{step + 1}", list(range(10)), PARAMS, lora_request=LORAS[0])
        engine.step()
        if "a3-0" in engine.scheduler.requests and engine.scheduler.requests["a3-0"].lora_slot is not None:
            admitted_at = step
            break
    # a1 (its requests end soonest) drains once a3 has waited twice its steps left, and takes no new request
    # until its slot frees.
    assert admitted_at is not None and admitted_at <= (LORA_DRAIN_PATIENCE + 1) * PARAMS.max_tokens
    assert engine.get_stats().lora_waiting == ("a1",)  # a1's latest requests wait now


def test_the_adapter_drained_for_a_waiting_one_is_the_one_that_ends_soonest(engine):
    # a1 runs one long request; a2 runs two that end in a few steps; a3 waits. Draining a1 (fewer requests) would
    # keep a3 out for ~40 steps; a2's slot frees within its requests' last tokens.
    engine.add_request("a1-0", list(range(10)), SamplingParams(max_tokens=40, ignore_eos=True), lora_request=LORAS[0])
    for i in range(2):
        engine.add_request(f"a2-{i}", list(range(10 + i)), PARAMS, lora_request=LORAS[1])
    engine.step()
    engine.add_request("a3-0", list(range(10)), PARAMS, lora_request=LORAS[2])
    admitted_at = None
    for step in range(40):
        engine.add_request(f"a2-{step + 2}", list(range(10)), PARAMS, lora_request=LORAS[1])  # a2 stays busy
        engine.step()
        if engine.scheduler.requests["a3-0"].lora_slot is not None:
            admitted_at = step
            break
    assert engine.scheduler.requests["a1-0"].lora_slot is not None  # the long request kept running throughout
    assert admitted_at is not None and admitted_at <= (LORA_DRAIN_PATIENCE + 1) * PARAMS.max_tokens


def test_a_running_adapter_takes_new_requests_until_the_waiting_one_has_waited_long_enough(engine):
    # Its slot is likely to free on its own soon: draining it at once would make its own new requests wait too.
    engine.add_request("a1-0", list(range(10)), PARAMS, lora_request=LORAS[0])
    engine.add_request("a2-0", list(range(10)), SamplingParams(max_tokens=40, ignore_eos=True),
                       lora_request=LORAS[1])  # fmt: skip
    engine.step()
    engine.add_request("a3-0", list(range(10)), PARAMS, lora_request=LORAS[2])
    engine.step()  # a3 is passed over: both slots are pinned
    engine.add_request("a1-1", list(range(10)), PARAMS, lora_request=LORAS[0])
    engine.step()
    requests = engine.scheduler.requests
    assert requests["a1-1"].lora_slot is not None and requests["a3-0"].lora_slot is None
    while requests["a3-0"].lora_slot is None:  # a1's slot frees once its two requests end
        engine.step()
    assert requests["a2-0"].lora_slot is not None and "a1-1" not in requests


def test_slot_table_reuses_a_resident_adapter_and_evicts_host_copies_lru():
    table = LoRASlotTable(num_slots=2, num_cpu=2)
    a, b, c = LORAS[:3]
    assert table.acquire(a) == 0 and table.acquire(b) == 1
    table.release(a)
    assert table.can_admit(c) and table.acquire(c) == 0  # a's slot, the least recently used free one
    updates = table.take_updates()
    assert [(load.slot, load.lora.lora_name) for load in updates.loads] == [(0, "a1"), (1, "a2"), (0, "a3")]
    assert updates.host_evictions == (1,)  # a1's host copy: two kept
    assert not table.can_admit(a)  # both slots pinned
    table.release(b)
    assert table.acquire(b) == 1 and not table.take_updates()  # still resident: no copy


def test_prefetch_reads_in_the_background_and_never_evicts_what_the_queue_ahead_waits_for():
    table = LoRASlotTable(num_slots=1, num_cpu=2)
    a, b, c, d = LORAS
    table.acquire(a)
    assert table.ready(a) and not table.ready(b)  # a sits in a slot; b was never read
    table.prefetch(b, keep=set())
    table.prefetch(c, keep={b.lora_int_id})  # evicts a's host copy (a is in its slot), not b
    table.prefetch(d, keep={b.lora_int_id, c.lora_int_id})  # no room without undoing b or c: waits
    updates = table.take_updates()
    assert [lora.lora_name for lora in updates.prefetches] == ["a2", "a3"]
    assert updates.host_evictions == (a.lora_int_id,)
    assert not table.ready(b) and not table.ready(c)  # read, but not reported yet
    table.mark_ready((b.lora_int_id,))
    assert table.ready(b) and not table.ready(c)
    table.release(a)
    assert table.acquire(b) == 0 and [load.lora.lora_name for load in table.take_updates().loads] == ["a2"]
