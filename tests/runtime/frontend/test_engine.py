"""LLMEngine: input validation, queue limit, aborts, executor failures, stats, and a property test over
random workloads (arrivals, lengths, shared prefixes, aborts, small pools that force preemption)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hpi_runtime.config import EngineConfig
from hpi_runtime.core.kv_budget import kv_tokens_per_request
from hpi_runtime.frontend.engine import EngineError, EngineStats, LLMEngine, QueueFullError
from hpi_runtime.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture
def make_engine(fake_executor_cls):
    def build(num_blocks: int = 32, **config) -> LLMEngine:
        cfg = EngineConfig(**{"block_size": 8, "max_model_len": 64, **config})
        return LLMEngine(cfg, fake_executor_cls(num_blocks, cfg.block_size), None, frozenset({0}))

    return build


def test_invalid_requests_raise_value_error(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], PARAMS)
    with pytest.raises(ValueError, match=r"64 tokens .*max_model_len=64"):
        engine.add_request("a", [1] * 64, PARAMS)
    engine.add_request("a", [1] * 63, PARAMS)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1], PARAMS)
    assert engine.get_stats().num_waiting == 1


def test_engine_refuses_mismatched_block_size_or_a_pool_below_max_model_len(fake_executor_cls):
    with pytest.raises(ValueError, match="block_size"):
        LLMEngine(EngineConfig(block_size=16), fake_executor_cls(512, 8), None, frozenset())
    with pytest.raises(ValueError, match="max_model_len=2048"):
        LLMEngine(EngineConfig(block_size=16), fake_executor_cls(100, 16), None, frozenset())


def test_queue_full_error_past_max_num_waiting(make_engine):
    engine = make_engine(max_num_waiting=2)
    engine.add_request("a", [1], PARAMS)
    engine.add_request("b", [1], PARAMS)
    with pytest.raises(QueueFullError, match="max_num_waiting=2") as info:
        engine.add_request("c", [1], PARAMS)
    assert isinstance(info.value, ValueError)
    engine.step()  # both admitted: the queue has room again
    engine.add_request("c", [1], PARAMS)


def test_abort_frees_blocks_at_once_and_reports_once(make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.add_request("run", [1] * 20, SamplingParams(max_tokens=30))
    engine.add_request("wait", [2] * 5, PARAMS)
    engine.step()
    assert engine.kv_cache_manager.pool.num_free == 32 - 3
    engine.abort_request(["run", "wait", "unknown"])
    assert engine.kv_cache_manager.pool.num_free == 32 and engine.get_stats().num_running == 0
    outputs = engine.step()
    assert {(o.request_id, o.finish_reason, o.finished) for o in outputs} == {
        ("run", "abort", True),
        ("wait", "abort", True),
    }
    assert not engine.has_unfinished_requests() and engine.step() == []
    engine.add_request("run", [1] * 20, PARAMS)  # the id is free again
    engine.step()
    assert "run" in engine.executor.batches[-1].finished_request_ids  # old state dropped before new


def test_executor_failure_fails_only_the_batch_and_engine_keeps_going(make_engine, pool_invariants):
    engine = make_engine(max_num_seqs=2)
    engine.executor.fail_on = {"bad"}
    engine.add_request("bad", [1] * 20, PARAMS)
    engine.add_request("peer", [1] * 20, PARAMS)
    engine.add_request("later", [1] * 20, PARAMS)  # waiting: not touched by the failing step
    with pytest.raises(EngineError) as info:
        engine.step()
    assert info.value.request_ids == {"bad", "peer"}
    pool_invariants(engine.kv_cache_manager)
    assert engine.kv_cache_manager.pool.num_free == 32
    assert engine.kv_cache_manager.pool.cached_blocks == {}  # KV never written: not left in the cache
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(finals) == {"later"} and finals["later"].finish_reason == "length"
    assert engine.executor.batches[1].finished_request_ids == {"bad", "peer"}  # told to drop them


def test_stats_and_shutdown(make_engine):
    engine = make_engine()
    assert engine.get_stats() == EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)
    engine.add_request("a", [5] * 17, PARAMS)
    engine.add_request("b", [5] * 17, PARAMS)
    engine.step()
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_prompt_tokens, stats.num_generation_tokens) == (2, 0, 34, 2)
    assert stats.kv_cache_usage == pytest.approx(4 / 32)  # a: 3 blocks; b shares a's 2 full ones + 1
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (34, 16)
    engine.shutdown()
    assert engine.executor.shut_down and not engine.scheduler.requests and engine.kv_cache_manager.pool.num_free == 32


# A workload: each request = (arrival step, shared-prefix choice, prompt tail length, max_tokens, abort).
# abort: None; ("step", n): aborted between steps, n steps after arrival; ("forward", n): aborted from inside
# the model forward of the n-th batch (from 0) that holds it, as AsyncLLM's aborts land while a step runs.
# Arrivals are close together, prompts share a few prefixes (their tails share tokens too) and the pool is
# a few blocks over one max-length request, so many examples preempt (more without an admission watermark)
# and most hit the prefix cache.
_request = st.tuples(
    st.integers(0, 12),
    st.integers(0, 3),
    st.integers(1, 20),
    st.integers(1, 24),
    st.one_of(st.none(), st.tuples(st.sampled_from(["step", "forward"]), st.integers(0, 12))),
)
_PREFIXES = ([7] * 20, [8] * 16 + [9] * 10, [8] * 16 + [5] * 3, [1, 2, 3])


@settings(max_examples=100, deadline=None)
@given(
    workload=st.lists(_request, min_size=3, max_size=14),
    block_size=st.sampled_from([8, 16]),
    spare_blocks=st.integers(0, 2),
    max_num_seqs=st.integers(2, 6),
    budget=st.integers(8, 64),
    caching=st.sampled_from([True, True, True, False]),
    watermark=st.sampled_from([0.0, 0.0, 0.0, 0.2, 0.5]),  # 0 preempts most; 0.5 defers most admissions
    host_blocks=st.sampled_from([0, 0, 1, 3, 8, 32]),  # the host KV tier: off, too small to swap, roomy
    window=st.sampled_from([None, None, None, 8, 13]),  # blocks behind a sliding window are freed
)
# Found by this test: a prefix hit longer than the pool (as a sliding window allows) was refused admission
# forever; hit blocks behind the window now come back as the placeholder, not held.
@example(
    workload=[(0, 0, 1, 1, None), (0, 0, 12, 1, None), (0, 0, 13, 1, None)],
    block_size=8, spare_blocks=0, max_num_seqs=2, budget=8, caching=True, watermark=0.0, host_blocks=0, window=8,
)  # fmt: skip
def test_random_workloads_keep_every_invariant(
    fake_executor_cls,
    pool_invariants,
    expected_token,
    workload,
    block_size,
    spare_blocks,
    max_num_seqs,
    budget,
    caching,
    watermark,
    host_blocks,
    window,
):
    max_model_len = 48
    num_tokens_needed = kv_tokens_per_request(max_model_len, block_size, window, budget)
    num_blocks = -(-num_tokens_needed // block_size) + spare_blocks
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_prefix_caching=caching,
        kv_admission_watermark=watermark,
        kv_sliding_window=window,
    )
    executor = fake_executor_cls(
        num_blocks, block_size, vocab_size=40, num_host_kv_blocks=host_blocks, sliding_window=window
    )
    engine = LLMEngine(config, executor, None, frozenset({0}))
    prompts = {
        f"r{i}": (_PREFIXES[p] + list(range(10, 10 + tail)))[: max_model_len - 1]
        for i, (_, p, tail, _, _) in enumerate(workload)
    }
    forward_aborts = {f"r{i}": r[4][1] for i, r in enumerate(workload) if r[4] and r[4][0] == "forward"}
    run_model = executor.execute_model

    def execute_and_abort(so):
        result = run_model(so)
        for rid in so.num_scheduled_tokens:
            if rid in forward_aborts:
                forward_aborts[rid] -= 1
                if forward_aborts[rid] < 0:
                    engine.abort_request([rid])  # the engine lock is not held here: AsyncLLM's case
        return result

    executor.execute_model = execute_and_abort
    finals, last_tokens, step = {}, {}, 0
    while step < 2000:
        for i, (arrival, _, _, max_tokens, abort) in enumerate(workload):
            rid = f"r{i}"
            if arrival == step:
                engine.add_request(rid, prompts[rid], SamplingParams(max_tokens=max_tokens))
            if abort is not None and abort[0] == "step" and arrival + abort[1] == step:
                engine.abort_request([rid])
        for output in engine.step():
            rid = output.request_id
            assert rid not in finals, "output after finish"
            previous = last_tokens.get(rid, ())
            assert output.output_token_ids == previous + output.new_token_ids, "tokens lost or sent twice"
            last_tokens[rid] = output.output_token_ids
            if output.finished:
                finals[rid] = output
        pool_invariants(engine.kv_cache_manager)
        assert len(engine.scheduler.running) <= max_num_seqs
        step += 1
        if step > 13 + 31 and not engine.has_unfinished_requests():
            break
    assert set(finals) == set(prompts), "every request finishes"
    kv = engine.kv_cache_manager
    num_held = 0 if kv.null_block is None else 1  # the window's placeholder, the manager's for good
    assert kv.pool.num_free == num_blocks - num_held, "no block leaked"
    assert sum(block.ref_cnt for block in kv.pool.blocks) == num_held
    assert not engine.kv_cache_manager._swapped, "a swap outlived its request"
    for batch in executor.batches:
        assert batch.total_num_scheduled_tokens <= budget and len(batch.num_scheduled_tokens) <= max_num_seqs
        assert batch.total_num_scheduled_tokens > 0 or batch.kv_transfers, "an empty batch reached the executor"
    for rid, output in finals.items():
        prompt_len = len(prompts[rid])
        _, _, _, max_tokens, abort = workload[int(rid[1:])]
        limit = min(max_tokens, max_model_len - prompt_len)
        # Same tokens as an uninterrupted run: preemption + recompute does not change the output.
        expected = tuple(expected_token(rid, prompt_len + j, 40) for j in range(len(output.output_token_ids)))
        assert output.output_token_ids == expected
        if output.finish_reason == "length":
            assert len(output.output_token_ids) == limit
        elif output.finish_reason == "stop":
            assert output.output_token_ids[-1] == 0 and len(output.output_token_ids) <= limit
            assert 0 not in output.output_token_ids[:-1]
        else:
            assert output.finish_reason == "abort" and abort is not None


def test_abort_and_id_reuse_while_the_step_runs(make_engine, pool_invariants):
    """AsyncLLM aborts from another thread while the model runs: the in-flight result for that request is
    dropped, and a new request that reuses the id is not confused with the old one."""
    engine = make_engine()
    engine.add_request("a", [1] * 10, PARAMS)
    engine.add_request("b", [2] * 10, PARAMS)
    run_model = engine.executor.execute_model

    def execute_and_abort(so):
        result = run_model(so)
        engine.abort_request(["a"])  # the lock is not held during the forward: no deadlock
        engine.add_request("a", [3] * 5, PARAMS)
        return result

    engine.executor.execute_model = execute_and_abort
    outputs = engine.step()
    engine.executor.execute_model = run_model
    assert [o.request_id for o in outputs] == ["b"]
    pool_invariants(engine.kv_cache_manager)
    new_a = engine.scheduler.requests["a"]
    assert new_a.output_token_ids == [] and new_a.num_computed_tokens == 0
    outputs = engine.step()
    assert ("a", "abort") in {(o.request_id, o.finish_reason) for o in outputs}
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["a"].prompt_token_ids == (3,) * 5 and finals["a"].finish_reason == "length"


def test_logprobs_are_passed_through_only_when_requested(make_engine):
    from hpi_runtime.core.interface import ModelRunnerOutput, TokenLogprobs

    engine = make_engine()
    run_model = engine.executor.execute_model

    def with_logprobs(so):
        result = run_model(so)
        logprobs = {
            rid: (TokenLogprobs(t[0], -0.5, ((t[0], -0.5), (7, -1.0))),) for rid, t in result.sampled_token_ids.items()
        }
        return ModelRunnerOutput(result.sampled_token_ids, logprobs)

    engine.executor.execute_model = with_logprobs
    engine.add_request("lp", [1] * 4, SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True))
    engine.add_request("plain", [1] * 4, PARAMS)
    outputs = [o for _ in range(3) for o in engine.step()]
    for output in outputs:
        if output.request_id == "lp":
            assert [lp.token_id for lp in output.new_logprobs] == list(output.new_token_ids)
        else:
            assert output.new_logprobs == ()


def test_failed_step_forgets_only_the_cache_entries_it_was_writing(make_engine):
    engine = make_engine()
    engine.add_request("a", [1] * 20, PARAMS)
    engine.step()  # a's two full blocks are written: valid cache entries
    engine.executor.fail_on = {"bad"}
    engine.add_request("bad", [1] * 16 + [5] * 10, PARAMS)  # shares a's 2 blocks, registers a third
    with pytest.raises(EngineError):
        engine.step()
    pool = engine.kv_cache_manager.pool
    assert not engine.scheduler.requests  # a was decoding in the failed batch, so it failed too
    assert len(pool.cached_blocks) == 2  # but its blocks written by the earlier step stay cached
    engine.executor.fail_on = set()
    engine.add_request("again", [1] * 16 + [5] * 10, PARAMS)
    engine.step()
    assert engine.executor.batches[-1].new_requests[0].num_computed_tokens == 16  # 2 hits, not 3
