"""Scheduler: the one catch-up rule under budgets, chunked prefill, prefix hits, preemption, fairness, priority,
admission headroom."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import pytest

from hpi_runtime.config import EngineConfig
from hpi_runtime.frontend.engine import LLMEngine
from hpi_runtime.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture
def make_engine(fake_executor_cls):
    def build(num_blocks: int = 64, **config) -> LLMEngine:
        cfg = EngineConfig(**{"block_size": 8, "max_model_len": 128, **config})
        return LLMEngine(cfg, fake_executor_cls(num_blocks, cfg.block_size), None, frozenset())

    return build


def test_long_prompt_is_chunked_under_the_token_budget(make_engine, expected_token):
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request("long", list(range(50)), SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = [engine.step() for _ in range(6)]
    batches = engine.executor.batches
    assert [b.num_scheduled_tokens["long"] for b in batches] == [16, 16, 16, 2, 1, 1]
    assert batches[0].new_requests[0].num_computed_tokens == 0
    assert [b.cached_requests[0].num_computed_tokens for b in batches[1:]] == [16, 32, 48, 50, 51]
    assert [len(o) for o in outputs] == [0, 0, 0, 1, 1, 1]  # nothing sampled until the prompt is done
    assert outputs[-1][0].output_token_ids == tuple(expected_token("long", p) for p in (50, 51, 52))
    assert outputs[-1][0].finished and engine.kv_cache_manager.pool.num_free == 64


def test_running_requests_go_first_and_budget_and_max_num_seqs_hold(make_engine, pool_invariants, drain):
    engine = make_engine(max_num_batched_tokens=20, max_num_seqs=3)
    for i in range(6):
        engine.add_request(f"r{i}", list(range(100 + i, 112 + i)), PARAMS)
    engine.step()
    first = engine.executor.batches[0]
    # FCFS admission: r0 (12 tokens) fits, r1 gets the last 8 of the budget as a first chunk.
    assert dict(first.num_scheduled_tokens) == {"r0": 12, "r1": 8}
    engine.step()
    assert list(engine.executor.batches[1].num_scheduled_tokens.items()) == [("r0", 1), ("r1", 4), ("r2", 12)]
    drain(engine, pool_invariants)
    for batch in engine.executor.batches:
        assert batch.total_num_scheduled_tokens <= 20 and len(batch.num_scheduled_tokens) <= 3


def test_prefix_hit_skips_cached_blocks_and_shares_them(make_engine, drain):
    engine = make_engine()
    prompt = list(range(40))
    engine.add_request("a", prompt, PARAMS)
    engine.step()
    engine.add_request("b", prompt, PARAMS)
    engine.step()
    new_b = engine.executor.batches[1].new_requests[0]
    assert new_b.num_computed_tokens == 32  # 5 full blocks cached, capped to leave the last token
    assert engine.executor.batches[1].num_scheduled_tokens["b"] == 8
    assert new_b.block_ids[:4] == engine.executor.batches[0].new_requests[0].block_ids[:4]
    finals = drain(engine)
    assert finals["b"].num_cached_prompt_tokens == 32 and finals["a"].num_cached_prompt_tokens == 0
    stats = engine.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)


def test_newest_running_request_is_preempted_and_recomputed_identically(make_engine, expected_token, drain):
    # 6 blocks of 8 tokens; three requests of 15 prompt tokens each take 2 blocks, so the first decode
    # step past 16 tokens needs a block that is not there: the newest (r2) must go.
    engine = make_engine(num_blocks=6, max_model_len=48, kv_admission_watermark=0.0)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [i] * 15, params)
    engine.step()  # prefill all three (15 tokens each)
    engine.step()  # decode token 16: fits the second blocks
    assert engine.get_stats().num_preemptions == 0
    engine.step()  # token 17 needs a third block for each: only r0 and r1 get one
    batch = engine.executor.batches[-1]
    assert list(batch.num_scheduled_tokens) == ["r0", "r1"]
    assert batch.preempted_request_ids == {"r2"}  # the executor drops its state before this step
    assert engine.get_stats().num_preemptions == 1
    assert [r.request_id for r in engine.scheduler.waiting] == ["r2"]
    assert engine.scheduler.waiting[0].status.value == "preempted"
    finals = drain(engine)
    for i in range(3):
        rid = f"r{i}"
        assert finals[rid].output_token_ids == tuple(expected_token(rid, 15 + j) for j in range(12))
    assert engine.kv_cache_manager.pool.num_free == 6


def test_preempted_request_goes_to_the_front_of_the_waiting_queue(make_engine, drain):
    engine = make_engine(num_blocks=4, max_model_len=32, max_num_seqs=2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("old", [1] * 15, params)
    engine.add_request("new", [2] * 15, params)
    engine.add_request("queued", [3] * 4, params)
    engine.step()
    engine.step()
    engine.step()  # both need a third block; 4 blocks: "new" is preempted
    assert [r.request_id for r in engine.scheduler.waiting] == ["new", "queued"]
    finals = drain(engine)
    admitted = sorted(finals.values(), key=lambda o: o.first_scheduled_time)
    assert [o.request_id for o in admitted] == ["old", "new", "queued"]


def test_no_starvation_under_a_steady_stream(make_engine, pool_invariants):
    """Arrivals faster than service: admission stays FCFS (nobody is overtaken), and each request's wait
    is bounded by the work queued ahead of it when it arrived, so early requests never starve."""
    engine = make_engine(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=32)
    arrived_at, admitted_at, arrivals = {}, {}, []
    finished = set()
    for step in range(400):
        if step < 200 and step % 2 == 0:
            rid = f"r{step}"
            prompt_len = 40 if step % 10 == 0 else 6  # some long prompts in the stream
            params = SamplingParams(max_tokens=5, ignore_eos=True)
            engine.add_request(rid, list(range(step, step + prompt_len)), params)
            arrivals.append(rid)
            arrived_at[rid] = (step, len(engine.scheduler.waiting) + len(engine.scheduler.running))
        finished |= {o.request_id for o in engine.step() if o.finished}
        for request in engine.scheduler.running:
            admitted_at.setdefault(request.request_id, step)
        pool_invariants(engine.kv_cache_manager)
    assert finished == set(arrivals) and not engine.has_unfinished_requests()
    assert sorted(admitted_at, key=admitted_at.get) == arrivals
    max_service_steps = 2 + 5  # a 40-token prompt in two chunks, then 5 decodes
    for rid, (step, num_ahead) in arrived_at.items():
        assert admitted_at[rid] - step <= (num_ahead + 1) * max_service_steps


def test_waiting_head_blocks_later_requests_fcfs(make_engine):
    """A request that does not fit yet is not overtaken by smaller ones behind it (no starvation)."""
    engine = make_engine(num_blocks=16, max_model_len=128)
    engine.add_request("a", [1] * 100, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.add_request("big", [2] * 60, PARAMS)  # 8 blocks; 13 held by "a"
    engine.add_request("small", [3] * 4, PARAMS)
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["big", "small"]


def test_priority_orders_admission_then_arrival(make_engine, drain):
    engine = make_engine(max_num_seqs=1)
    for rid, priority in (("low", 1), ("a", 0), ("b", 0), ("urgent", -1), ("c", 0), ("urgent2", -1)):
        engine.add_request(rid, [1, 2, 3], PARAMS, priority=priority)
    assert [r.request_id for r in engine.scheduler.waiting] == ["urgent", "urgent2", "a", "b", "c", "low"]
    drain(engine)
    admitted = [new.request_id for batch in engine.executor.batches for new in batch.new_requests]
    assert admitted == ["urgent", "urgent2", "a", "b", "c", "low"]


def test_preempted_request_stays_ahead_of_higher_priority_arrivals(make_engine, drain):
    engine = make_engine(num_blocks=4, max_model_len=32, max_num_seqs=2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("old", [1] * 15, params, priority=5)
    engine.add_request("new", [2] * 15, params, priority=5)
    engine.step()
    engine.step()
    engine.add_request("urgent", [3] * 4, params, priority=-5)
    engine.step()  # both running need a third block; 4 blocks: "new" is preempted and requeued at the front
    assert [r.request_id for r in engine.scheduler.waiting] == ["new", "urgent"]
    engine.add_request("urgent2", [4] * 4, params, priority=-5)  # same priority: behind "urgent" by arrival
    assert [r.request_id for r in engine.scheduler.waiting] == ["new", "urgent", "urgent2"]
    finals = drain(engine)
    admitted = sorted(finals.values(), key=lambda o: o.first_scheduled_time)
    assert [o.request_id for o in admitted] == ["old", "new", "urgent", "urgent2"]


@pytest.mark.parametrize("watermark", [-0.01, 1.0, 1.5, float("nan")])
def test_kv_admission_watermark_must_be_a_fraction_below_one(watermark):
    with pytest.raises(ValueError, match="kv_admission_watermark"):
        EngineConfig(kv_admission_watermark=watermark)
    assert EngineConfig(kv_admission_watermark=0.99).kv_admission_watermark == 0.99


def test_admission_stops_at_the_watermark(make_engine, pool_invariants, drain):
    # 20 blocks, watermark 0.25: 5 must stay free. Each 15-token prompt takes 2 blocks, so admission stops
    # at 6 free (the next would leave 4); without the watermark it fills the pool.
    for watermark, num_admitted in ((0.25, 7), (0.0, 10)):
        engine = make_engine(num_blocks=20, kv_admission_watermark=watermark, max_num_batched_tokens=512)
        assert engine.scheduler.num_watermark_blocks == int(watermark * 20)
        for i in range(12):
            engine.add_request(f"r{i}", [i] * 15, PARAMS)
        engine.step()
        assert list(engine.executor.batches[0].num_scheduled_tokens) == [f"r{i}" for i in range(num_admitted)]
        assert engine.kv_cache_manager.pool.num_free == 20 - 2 * num_admitted
        drain(engine, pool_invariants)


def test_watermark_counts_the_whole_prompt_not_the_first_chunk(make_engine):
    engine = make_engine(num_blocks=16, kv_admission_watermark=0.25, max_num_batched_tokens=16)  # 4 stay free
    engine.add_request("a", [1] * 30, SamplingParams(max_tokens=30, ignore_eos=True))  # 4 blocks, then 8
    engine.step()
    engine.step()
    # 12 free; a 70-token prompt's first chunk needs 2 blocks, the whole prompt 9: 3 would be left.
    engine.add_request("long", [2] * 70, PARAMS)
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["long"]
    assert list(engine.executor.batches[-1].num_scheduled_tokens) == ["a"]


def test_headroom_avoids_the_preemption_a_full_pool_causes(make_engine, expected_token, drain):
    # 6 blocks of 8 tokens; three 15-token prompts take 2 blocks each and grow to 24 tokens (3 blocks). Filling
    # the pool admits all three and preempts r2 at token 17; keeping 2 blocks free lets r2 wait instead.
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for watermark, num_admitted, num_preemptions in ((0.0, 3, 1), (0.34, 2, 0)):
        engine = make_engine(num_blocks=6, max_model_len=48, kv_admission_watermark=watermark)
        for i in range(3):
            engine.add_request(f"r{i}", [i] * 15, params)
        engine.step()
        assert len(engine.executor.batches[0].num_scheduled_tokens) == num_admitted
        finals = drain(engine)
        assert engine.get_stats().num_preemptions == num_preemptions
        for i in range(3):
            assert finals[f"r{i}"].output_token_ids == tuple(expected_token(f"r{i}", 15 + j) for j in range(10))


def test_request_larger_than_the_headroom_is_admitted_once_nothing_runs(make_engine, pool_invariants, drain):
    """No starvation or deadlock: the watermark only defers admission while something runs, and running
    requests always finish, so a prompt that can never leave the watermark free still gets its turn."""
    engine = make_engine(num_blocks=16, kv_admission_watermark=0.5)  # 8 of 16 blocks stay free
    engine.add_request("alone", [1] * 100, PARAMS)  # 13 blocks: would leave 3
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["alone"]
    drain(engine, pool_invariants)

    engine.add_request("small", [2] * 4, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.add_request("big", [3] * 100, PARAMS)
    engine.add_request("after", [4] * 4, PARAMS)  # fits, but FCFS: does not overtake "big"
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == ["big", "after"]
    admitted_at, finished_at = {}, {}
    for step in range(200):
        finished_at.update((output.request_id, step) for output in engine.step() if output.finished)
        for request in engine.scheduler.running:
            admitted_at.setdefault(request.request_id, step)
        pool_invariants(engine.kv_cache_manager)
        if not engine.has_unfinished_requests():
            break
    assert set(finished_at) == {"small", "big", "after"}
    assert admitted_at["big"] == finished_at["small"] + 1  # the first step with nothing running
    assert admitted_at["after"] > admitted_at["big"]


class _LazyFuture(Future):
    """A batch's result, computed when the engine first asks for it (its batches' results come back in order)."""

    def __init__(self, executor) -> None:
        super().__init__()
        self.executor = executor

    def result(self, timeout=None):
        while not super().done():
            so, future = self.executor.pending.popleft()
            future.set_result(self.executor.execute_model(so))
        return super().result(timeout)


def test_each_batch_in_flight_takes_its_share_of_the_requests(fake_executor_cls, expected_token, drain):
    """An executor that runs 3 batches at once (pipeline stages, as on CPU: one more than stages): the engine
    submits batches without waiting, each with a third of the requests, none in two batches at once, and every
    request still gets its own tokens."""

    class PipelinedExecutor(fake_executor_cls):
        max_concurrent_batches = 3

        def __post_init__(self) -> None:
            super().__post_init__()
            self.pending = deque()

        def submit(self, so) -> Future:
            future = _LazyFuture(self)
            self.pending.append((so, future))
            return future

    cfg = EngineConfig(block_size=8, max_model_len=128)
    executor = PipelinedExecutor(64, cfg.block_size)
    engine = LLMEngine(cfg, executor, None, frozenset())
    for i in range(9):
        engine.add_request(f"r{i}", list(range(10 * i, 10 * i + 5)), SamplingParams(max_tokens=6, ignore_eos=True))
    finals = drain(engine)
    first = [set(batch.num_scheduled_tokens) for batch in executor.batches[:3]]
    assert all(len(batch) == 3 for batch in first) and set().union(*first) == {f"r{i}" for i in range(9)}
    assert all(len(batch.num_scheduled_tokens) <= 3 for batch in executor.batches)
    for i in range(9):
        assert finals[f"r{i}"].output_token_ids == tuple(expected_token(f"r{i}", 5 + j) for j in range(6))
