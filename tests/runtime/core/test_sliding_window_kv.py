"""Blocks behind a sliding window: freed as a request grows (its table points them at one placeholder), so
a request far longer than the pool runs in it; tokens, prefix hits, preemption and swaps stay right.

The fake executor reads back each new token's window only, as a windowed kernel does: a block freed while
still inside some query's window shows up as a position holding the wrong token."""

from __future__ import annotations

import pytest

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.block_pool import sha256_hash
from hpi_runtime.core.kv_budget import kv_tokens_per_request
from hpi_runtime.core.kv_cache_manager import KVCacheManager
from hpi_runtime.core.request import BlockHasher, Request
from hpi_runtime.frontend.engine import LLMEngine
from hpi_runtime.sampling_params import SamplingParams

from .conftest import drain_engine

BLOCK, WINDOW = 8, 20


@pytest.fixture
def make_engine(fake_executor_cls):
    def build(num_blocks: int, num_host_blocks: int = 0, **config) -> LLMEngine:
        cfg = EngineConfig(**{"block_size": BLOCK, "max_model_len": 400, "max_num_batched_tokens": 16,
                              "kv_sliding_window": WINDOW, "kv_admission_watermark": 0.0, **config})  # fmt: skip
        executor = fake_executor_cls(num_blocks, BLOCK, num_host_kv_blocks=num_host_blocks, sliding_window=WINDOW)
        return LLMEngine(cfg, executor, None, frozenset())

    return build


def blocks_held(engine: LLMEngine) -> int:
    """The most real (non-placeholder) blocks any request holds right now."""
    kv = engine.kv_cache_manager
    return max((sum(1 for b in blocks if b is not kv.null_block) for blocks in kv.req_to_blocks.values()), default=0)


def test_a_request_much_longer_than_the_pool_runs_in_its_window(make_engine, pool_invariants, expected_token):
    # 10 blocks (80 slots) for a 300-token prompt + 60 outputs: only the window and one chunk are ever held.
    engine = make_engine(num_blocks=10)
    engine.add_request("long", [3] * 300, SamplingParams(max_tokens=60, ignore_eos=True))
    peaks = []
    finals = drain_engine(engine, pool_invariants, after_step=lambda e: peaks.append(blocks_held(e)))
    assert finals["long"].output_token_ids == tuple(expected_token("long", 300 + j) for j in range(60))
    assert max(peaks) <= -(-(WINDOW + 16) // BLOCK) + 1
    assert engine.kv_cache_manager.pool.num_free == 10 - 1  # all back but the placeholder


def test_several_requests_and_a_prefix_hit_under_a_window(make_engine, pool_invariants, expected_token):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = make_engine(num_blocks=12)
    engine.add_request("r0", [1] * 50, SamplingParams(max_tokens=8, ignore_eos=True))  # 8 blocks: none reused
    finals = drain_engine(engine, pool_invariants)
    # r0's prompt blocks were freed by its window as it grew, but stay cached (by hash) until evicted.
    engine.add_request("again", [1] * 50 + [9] * 3, params)
    for i in (1, 2):
        engine.add_request(f"r{i}", [i + 1] * 50, params)
    finals.update(drain_engine(engine, pool_invariants))
    assert engine.get_stats().prefix_cache_hits == 48
    for rid, prompt_len in (("r0", 50), ("r1", 50), ("r2", 50), ("again", 53)):
        num_tokens = len(finals[rid].output_token_ids)
        assert finals[rid].output_token_ids == tuple(expected_token(rid, prompt_len + j) for j in range(num_tokens))


def test_a_swap_skips_blocks_behind_the_window_and_resumes_with_the_placeholder():
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK, num_host_blocks=8, sliding_window=WINDOW)
    request = Request("a", list(range(1, 61)), SamplingParams(), max_tokens=4, eos_token_ids=frozenset(),
                      arrival_time=0.0, hasher=BlockHasher(BLOCK, sha256_hash))  # fmt: skip
    assert kv.allocate_slots(request, 16, kv.get_computed_blocks(request)) is not None
    for _ in range(3):  # three more 16-token chunks: computed 16 -> 64 tokens would be 8 blocks without a window
        request.num_computed_tokens += 16
        kv.allocate_slots(request, min(16, request.num_tokens - request.num_computed_tokens))
        kv.begin_step()
    request.num_computed_tokens = 59
    table = kv.req_to_blocks["a"]
    num_dropped = (59 - 16 - WINDOW) // BLOCK  # freed when the last chunk was scheduled at 48 computed
    assert table[: (48 - WINDOW) // BLOCK] == [kv.null_block] * ((48 - WINDOW) // BLOCK) and num_dropped >= 2
    assert kv.preempt(request)
    swapped = kv._swapped["a"]
    assert swapped.host_blocks[: (48 - WINDOW) // BLOCK] == (None,) * ((48 - WINDOW) // BLOCK)
    assert all(block is not None for block in swapped.host_blocks[(48 - WINDOW) // BLOCK :])
    request.num_computed_tokens = 0
    computed = kv.get_computed_blocks(request)
    assert computed.num_tokens == 59
    assert computed.device_blocks[: (48 - WINDOW) // BLOCK] == (kv.null_block,) * ((48 - WINDOW) // BLOCK)
    assert kv.allocate_slots(request, 1, computed) is not None
    assert kv.null_block.ref_cnt == 1 and kv.null_block.block_hash is None


def test_the_pool_must_hold_a_window_and_a_chunk_not_max_model_len(fake_executor_cls):
    needed = kv_tokens_per_request(400, BLOCK, WINDOW, 16)
    assert needed == WINDOW + 16 + 2 * BLOCK + BLOCK and kv_tokens_per_request(400, BLOCK) == 400
    config = EngineConfig(block_size=BLOCK, max_model_len=400, max_num_batched_tokens=16, kv_sliding_window=WINDOW)
    LLMEngine(config, fake_executor_cls(-(-needed // BLOCK), BLOCK), None, frozenset())
    with pytest.raises(ValueError, match="less than one request"):
        LLMEngine(config, fake_executor_cls(-(-needed // BLOCK) - 1, BLOCK), None, frozenset())
    with pytest.raises(ValueError, match="kv_sliding_window"):
        EngineConfig(kv_sliding_window=0)
