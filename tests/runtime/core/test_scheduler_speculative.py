"""The scheduler with speculative decoding, over the fake executor (which checks every position's KV): drafts
are extra scheduled tokens with blocks of their own, rejected ones are rolled back and overwritten, prefix-cache
blocks never hold a draft, and block accounting holds through preemptions and prefix sharing."""

from __future__ import annotations

import random

from hpi_runtime.config import EngineConfig
from hpi_runtime.frontend.engine import LLMEngine
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.spec_decode.params import parse_speculative_config

NGRAM = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64})


def periodic_token(request_id: str, position: int) -> int:
    """A fake model that mostly repeats a short cycle (so prompt lookup is often right) and sometimes breaks it."""
    period = 3 + len(request_id) % 3
    return 900 + position % 7 if position % 11 == 0 else 100 + position % period


def make_engine(fake_executor_cls, num_blocks: int, **config) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 8, "max_model_len": 96, "speculative": NGRAM, **config})
    executor = fake_executor_cls(num_blocks, cfg.block_size, token_fn=periodic_token)
    return LLMEngine(cfg, executor, None, frozenset())


def test_drafts_are_scheduled_verified_and_rolled_back(fake_executor_cls) -> None:
    engine = make_engine(fake_executor_cls, 64)
    prompt = [periodic_token("r", p) for p in range(1, 13)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # the prompt
    request = engine.scheduler.requests["r"]
    for _ in range(3):
        num_tokens = request.num_tokens
        engine.step()
        batch = engine.executor.batches[-1]
        drafts = batch.spec_token_ids.get("r", ())
        assert batch.num_scheduled_tokens["r"] == 1 + len(drafts)
        accepted = request.num_tokens - num_tokens - 1
        assert 0 <= accepted <= len(drafts)
        # Progress covers the accepted tokens only; hashes cover only full blocks of known tokens.
        assert request.num_computed_tokens == request.num_tokens - 1
        assert len(request.block_hashes) == request.num_tokens // 8
    stats = engine.get_stats()
    assert stats.spec_num_drafts == 3 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_random_workloads_keep_every_invariant_with_drafts(fake_executor_cls, pool_invariants, drain) -> None:
    """Shared prompts (prefix hits), a pool too small for all (preemptions), max_tokens cuts: every request's
    tokens are the fake model's, every position's KV is checked, and the pool ends empty."""
    rng = random.Random(7)
    engine = make_engine(fake_executor_cls, 20, max_num_batched_tokens=24, kv_admission_watermark=0.0)
    expected = {}
    for i in range(24):
        request_id = f"q{i}"
        prompt = [periodic_token("shared", p) for p in range(rng.choice((8, 12, 17)))]
        max_tokens = rng.randint(1, 40)
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        expected[request_id] = tuple(periodic_token(request_id, len(prompt) + j) for j in range(max_tokens))
    finals = drain(engine, pool_invariants)
    assert {r: o.output_token_ids for r, o in finals.items()} == expected
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_num_accepted_tokens > 0
    assert engine.kv_cache_manager.pool.num_free == 20


def irregular_token(request_id: str, position: int) -> int:
    """A fake model whose tokens never repeat within a request, the same for every request: only another
    request's tokens can predict them."""
    return 100 + (position * 37) % 997


def test_a_repeated_request_drafts_from_the_cache_at_its_first_decode(fake_executor_cls) -> None:
    """`suffix` with a cross-request cache: the second request with the same prompt gets the first one's output
    as drafts from its first decode step, all accepted; without the cache it gets none."""
    config = {"method": "suffix", "num_speculative_tokens": 6, "disable_by_batch_size": 64}
    for num_cached, expect_drafts in ((4, True), (0, False)):
        cfg = EngineConfig(block_size=8, max_model_len=96, speculative=parse_speculative_config(
            {**config, "suffix_decoding_max_cached_requests": num_cached}))  # fmt: skip
        engine = LLMEngine(cfg, fake_executor_cls(64, 8, token_fn=irregular_token), None, frozenset())
        prompt = [irregular_token("", p) for p in range(10)]
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        engine.add_request("first", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("again", prompt, params)
        engine.step()  # the prompt, and the first output token
        engine.step()  # the first decode
        drafts = engine.executor.batches[-1].spec_token_ids.get("again", ())
        if expect_drafts:
            assert list(drafts) == [irregular_token("", p) for p in range(11, 17)]
            assert engine.get_stats().spec_num_accepted_tokens == 6
        else:
            assert not drafts
