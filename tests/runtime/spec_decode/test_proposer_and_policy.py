"""Speculative decoding's pure parts: the config's checks, prompt-lookup / suffix proposals, draft acceptance,
the per-request draft length and the step-time rule that switches speculation off."""

from __future__ import annotations

import pytest

from hpi_runtime.config import EngineArgs
from hpi_runtime.spec_decode.params import parse_speculative_config
from hpi_runtime.spec_decode.policy import SpeculationPolicy, StepTimes, next_num_draft_tokens
from hpi_runtime.spec_decode.proposer import Proposer
from hpi_runtime.spec_decode.verify import num_accepted


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 3}', "unknown method 'eagle'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be at least 1"),
        ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
        ('{"num_speculative_tokens": 2}', "'method' is required"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key(s) ['lookahead']"),
        ('{"method": "ngram", "model": "/models/draft", "num_speculative_tokens": 2}',
         "a draft 'model' goes with method 'draft_model'"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "a draft 'model' goes with method 'draft_model'"),
        ('{"model": "", "num_speculative_tokens": 2}', "'model' must be a model directory or name"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "prompt_lookup_min (4) is above prompt_lookup_max (2)",
        ),
        ('{"method": "ngram", "num_speculative_tokens": "5"}', "must be an integer"),
        ("{method: ngram}", "not valid JSON"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(config: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EngineArgs.from_options(speculative_config=config)


def test_a_dict_config_is_kept_as_json_and_one_lookup_bound_sets_the_other() -> None:
    args = EngineArgs.from_options(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_max": 3})  # fmt: skip
    params = args.speculative.params
    assert (params.method, params.num_speculative_tokens, params.prompt_lookup_min, params.prompt_lookup_max) == (
        "ngram", 3, 3, 3)  # fmt: skip
    assert parse_speculative_config(args.speculative.speculative_config) == params
    assert EngineArgs().speculative.params is None
    draft = EngineArgs.from_options(speculative_config={"model": "/models/draft", "num_speculative_tokens": 4})
    assert (draft.speculative.params.method, draft.speculative.params.model) == ("draft_model", "/models/draft")


def test_ngram_proposes_what_followed_the_longest_match() -> None:
    ngram = Proposer(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_min": 2, "prompt_lookup_max": 3}))  # fmt: skip
    # The last 3 tokens (7 8 9) occurred at 1..3, followed by 10 11 12; the 2-token match (8 9) at 6..7 is
    # shorter, so it loses although it is more recent.
    assert ngram.propose([5, 7, 8, 9, 10, 11, 12, 8, 9, 4, 7, 8, 9], 3) == [10, 11, 12]
    assert ngram.propose([5, 7, 8, 9, 10, 11, 12, 8, 9, 4, 7, 8, 9], 2) == [10, 11]
    assert ngram.propose([1, 2, 3, 4, 5, 6], 3) == []  # no repeat
    assert ngram.propose([1, 2, 9, 3, 2], 3) == []  # a 1-token match is below prompt_lookup_min
    assert ngram.propose([1, 2, 3, 1, 2], 0) == []
    # A repeating run: the latest occurrence with room for 3 tokens after it, not the one just before the end.
    assert ngram.propose([4, 6, 6, 6, 6, 6, 6], 3) == [6, 6, 6]


def test_suffix_takes_any_match_length_and_proposes_no_more_than_it_matched() -> None:
    suffix = Proposer(parse_speculative_config({"method": "suffix", "num_speculative_tokens": 8}))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5]
    assert suffix.propose(tokens, 8) == [6, 7, 8, 9, 10]  # matched 5 tokens: at most 5 proposed
    assert suffix.propose([3, 9, 8, 3], 8) == [9]  # a 1-token match proposes one


def test_acceptance_is_the_common_prefix_of_drafts_and_samples() -> None:
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4, 5, 6], [1, 5, 6, 7]) == 0
    assert num_accepted([], [3]) == 0


def test_draft_length_grows_on_full_acceptance_and_shrinks_to_what_was_accepted() -> None:
    assert next_num_draft_tokens(3, 3, current=3, maximum=5) == 4
    assert next_num_draft_tokens(5, 5, current=5, maximum=5) == 5
    assert next_num_draft_tokens(4, 1, current=4, maximum=5) == 2
    assert next_num_draft_tokens(4, 0, current=4, maximum=5) == 1
    assert next_num_draft_tokens(0, 0, current=3, maximum=5) == 3  # nothing proposed: nothing learnt


def _policy_with_curve(seconds_of, token_counts) -> SpeculationPolicy:
    policy = SpeculationPolicy()
    for num_tokens in token_counts:
        for _ in range(3):
            policy.step_times.record(num_tokens, seconds_of(num_tokens))
    return policy


def test_speculation_stops_where_the_measured_step_time_turns_compute_bound() -> None:
    """A roofline-shaped curve: flat (memory-bound) up to 16 tokens, then linear. With drafts accepted half the
    time, verifying 4 drafts per decode pays at small batches and not at large ones."""
    curve = _policy_with_curve(lambda t: 0.02 * max(1.0, t / 16), [1, 2, 4, 8, 16, 32, 64, 128, 256])
    for _ in range(100):
        curve.record_verification(4, 2, 4)
    assert curve.should_speculate(num_decodes=1, num_draft_tokens=4)
    assert curve.should_speculate(num_decodes=2, num_draft_tokens=8)
    assert not curve.should_speculate(num_decodes=32, num_draft_tokens=128)
    assert not curve.should_speculate(num_decodes=16, num_draft_tokens=64)
    # An unmeasured plain step runs plain first (it measures it); an unmeasured large step is tried.
    fresh = _policy_with_curve(lambda t: 0.02, [1])
    assert not fresh.should_speculate(num_decodes=3, num_draft_tokens=4)
    assert fresh.should_speculate(num_decodes=1, num_draft_tokens=4)
    # Past the largest measured step: extrapolated from the two largest (here steeply rising: off).
    steep = _policy_with_curve(lambda t: 0.02 * t, [16, 32])
    assert not steep.should_speculate(num_decodes=32, num_draft_tokens=128)
    capped = SpeculationPolicy(disable_by_batch_size=4)
    assert capped.should_speculate(4, 4) and not capped.should_speculate(5, 4)


def test_step_times_interpolate_between_measured_buckets() -> None:
    times = StepTimes()
    for _ in range(3):
        times.record(10, 1.0)
        times.record(20, 2.0)
    assert times.estimate(15) == pytest.approx(1.5)
    assert times.estimate(10) == pytest.approx(1.0)
    assert times.estimate(25) is None and times.estimate(5) is None
    assert times.estimate(30, extrapolate=True) == pytest.approx(3.0)  # along the line through the last two
    assert times.estimate(5, extrapolate=True) is None


def test_a_stale_measurement_is_forgotten_so_the_decision_is_revisited() -> None:
    """Verification steps measured slow (under load) turn speculation off at one decode; once their bucket has
    gone unmeasured for long enough, the rule speculates again to re-measure it."""
    policy = _policy_with_curve(lambda t: 0.02 if t == 1 else 0.5, [1, 6])
    for _ in range(10):
        policy.record_verification(5, 1, 5)
    assert not policy.should_speculate(num_decodes=1, num_draft_tokens=5)
    for _ in range(2001):  # plain steps only: the 6-token bucket ages
        policy.step_times.record(1, 0.02)
    assert policy.should_speculate(num_decodes=1, num_draft_tokens=5)


def test_the_suffix_cache_is_bounded_and_never_matches_across_two_requests() -> None:
    params = parse_speculative_config({"method": "suffix", "num_speculative_tokens": 4,
                                       "suffix_decoding_max_cached_requests": 2})  # fmt: skip
    proposer = Proposer(params)
    proposer.request_finished([1, 2, 3], [4, 5, 6, 7])
    assert proposer.propose([9, 2, 3, 4], 4) == [5, 6, 7]  # matched "2 3 4": at most 3 tokens, up to its end
    proposer.request_finished([8], [10, 11])
    assert proposer.propose([7, 8], 4) == [10]  # "7 8" spans two cached requests: only "8" matches
    proposer.request_finished([12], [13])  # the first request leaves the cache
    assert proposer.propose([9, 2, 3, 4], 4) == []
    with pytest.raises(ValueError, match="goes with method 'suffix'"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4,
                                  "suffix_decoding_max_cached_requests": 2})  # fmt: skip
