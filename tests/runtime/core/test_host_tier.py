"""The host-memory KV tier in the engine core: offload on eviction, loads on a host prefix hit, swap on
preemption with recompute as the fallback, and nothing leaked or read before it is written.

The fake executor (conftest.py) runs each step's block copies on a fake host cache and checks, before every
"sample", that each position of a request reads back its own token: a block offloaded, swapped or loaded to
the wrong place, or read before its copy, fails the test.
"""

from __future__ import annotations

import pytest

from hpi_runtime.config import EngineConfig
from hpi_runtime.frontend.engine import EngineError, LLMEngine
from hpi_runtime.sampling_params import SamplingParams

from .conftest import drain_engine

BLOCK = 8


@pytest.fixture
def make_engine(fake_executor_cls):
    def build(num_blocks: int, num_host_blocks: int, **config) -> LLMEngine:
        cfg = EngineConfig(**{"block_size": BLOCK, "max_model_len": 48, "kv_admission_watermark": 0.0, **config})
        executor = fake_executor_cls(num_blocks, BLOCK, num_host_kv_blocks=num_host_blocks)
        return LLMEngine(cfg, executor, None, frozenset())

    return build


def conversation_turns(engine: LLMEngine, pool_invariants) -> tuple[dict, int]:
    """A conversation's prefix is evicted by another one, then the conversation comes back: (outputs, tokens
    the second visit had to compute)."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    history = list(range(1, 33))  # 4 full blocks
    engine.add_request("turn1", history, params)
    first = drain_engine(engine, pool_invariants)
    engine.add_request("other", [90 + i % 7 for i in range(40)], params)  # needs every block: evicts turn1's
    first.update(drain_engine(engine, pool_invariants))
    before = engine.get_stats().num_prefill_tokens_computed
    engine.add_request("turn2", history + [77] * 5, params)
    first.update(drain_engine(engine, pool_invariants))
    return first, engine.get_stats().num_prefill_tokens_computed - before


def test_evicted_prefix_comes_back_from_the_host_tier(make_engine, pool_invariants, expected_token):
    engine = make_engine(num_blocks=6, num_host_blocks=8)
    outputs, computed = conversation_turns(engine, pool_invariants)
    stats = engine.get_stats()
    assert stats.kv_blocks_to_host >= 4  # turn1's four full blocks were offloaded when "other" evicted them
    assert stats.prefix_cache_host_hits == 32 and stats.prefix_cache_hits >= 32
    assert stats.kv_blocks_to_device == 4
    assert computed == 37 - 32  # only the new user turn ran through the model
    assert outputs["turn2"].output_token_ids == tuple(expected_token("turn2", 37 + j) for j in range(2))

    off = make_engine(num_blocks=6, num_host_blocks=0)
    _, computed_off = conversation_turns(off, pool_invariants)
    assert computed_off == 37 and off.get_stats().prefix_cache_host_hits == 0


def test_a_device_hit_beats_a_host_hit_and_nothing_is_copied_twice(make_engine, pool_invariants):
    engine = make_engine(num_blocks=12, num_host_blocks=8)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("a", list(range(1, 33)), params)
    drain_engine(engine, pool_invariants)
    engine.add_request("b", list(range(1, 33)) + [5], params)  # the pool never filled: a device hit
    drain_engine(engine, pool_invariants)
    stats = engine.get_stats()
    assert stats.kv_blocks_to_host == 0 and stats.kv_blocks_to_device == 0
    assert stats.prefix_cache_hits == 32 and stats.prefix_cache_host_hits == 0


def preemption_workload(engine: LLMEngine) -> None:
    # 6 blocks of 8 tokens; three 15-token prompts take 2 blocks each, so the decode of token 17 runs out
    # of blocks and the newest request (r2) is preempted.
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [i + 1] * 15, params)


def test_preempted_request_is_swapped_out_and_resumes_without_recompute(make_engine, pool_invariants, expected_token):
    engine = make_engine(num_blocks=6, num_host_blocks=8, max_model_len=40)
    preemption_workload(engine)
    finals = drain_engine(engine, pool_invariants)
    stats = engine.get_stats()
    assert stats.num_preemptions >= 1 and stats.num_swapped_preemptions == stats.num_preemptions
    resumed = [
        batch for batch in engine.executor.batches
        if any(new.request_id == "r2" and new.num_computed_tokens > 0 for new in batch.new_requests)
    ]  # fmt: skip
    assert resumed, "r2 was never readmitted with its KV"
    assert resumed[0].num_scheduled_tokens["r2"] == 1  # just the newest token: its KV came back from host
    assert resumed[0].kv_transfers.to_device
    # Prompt tokens computed: each prompt once (45), no recompute.
    assert stats.num_prefill_tokens_computed == 45
    for i in range(3):
        rid = f"r{i}"
        assert finals[rid].output_token_ids == tuple(expected_token(rid, 15 + j) for j in range(12))


def test_without_room_in_the_host_tier_preemption_recomputes(make_engine, pool_invariants, expected_token):
    engine = make_engine(num_blocks=6, num_host_blocks=1, max_model_len=40)  # r2 needs 2 host blocks
    preemption_workload(engine)
    finals = drain_engine(engine, pool_invariants)
    stats = engine.get_stats()
    assert stats.num_preemptions >= 1 and stats.num_swapped_preemptions == 0
    assert stats.num_prefill_tokens_computed > 45  # r2's 16 known tokens ran again
    assert finals["r2"].output_token_ids == tuple(expected_token("r2", 15 + j) for j in range(12))


def test_aborting_a_swapped_out_request_frees_its_host_blocks(make_engine, pool_invariants):
    engine = make_engine(num_blocks=6, num_host_blocks=4, max_model_len=40)
    preemption_workload(engine)
    for _ in range(10):
        engine.step()
        pool_invariants(engine.kv_cache_manager)
        if engine.kv_cache_manager._swapped:
            break
    (swapped_id,) = engine.kv_cache_manager._swapped
    engine.abort_request([swapped_id])
    engine.step()  # the step that follows releases the copies' own references
    pool_invariants(engine.kv_cache_manager)
    assert not engine.kv_cache_manager._swapped
    host = engine.kv_cache_manager.host
    assert host.pool.num_free == host.num_blocks - len(host._held)
    drain_engine(engine, pool_invariants)


def test_a_failed_step_drops_its_swaps_and_offloads(make_engine, pool_invariants, expected_token):
    engine = make_engine(num_blocks=6, num_host_blocks=4, max_model_len=40)
    preemption_workload(engine)
    engine.step()
    engine.step()
    engine.executor.fail_on = {"r0"}  # the step that preempts r2 (swapping it out) fails
    with pytest.raises(EngineError):
        engine.step()
    engine.executor.fail_on = set()
    kv = engine.kv_cache_manager
    assert not kv._swapped and not kv.host.pool.cached_blocks  # its copies may never have run
    pool_invariants(kv)
    finals = drain_engine(engine, pool_invariants)
    assert finals["r2"].output_token_ids == tuple(expected_token("r2", 15 + j) for j in range(12))


def test_offload_needs_prefix_caching_but_swap_does_not(make_engine, pool_invariants, expected_token):
    engine = make_engine(num_blocks=6, num_host_blocks=4, max_model_len=40, enable_prefix_caching=False)
    preemption_workload(engine)
    finals = drain_engine(engine, pool_invariants)
    stats = engine.get_stats()
    assert stats.num_swapped_preemptions >= 1 and stats.prefix_cache_hits == 0
    assert finals["r2"].output_token_ids == tuple(expected_token("r2", 15 + j) for j in range(12))
