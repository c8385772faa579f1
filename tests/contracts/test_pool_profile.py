"""The pool-profile contract: the JSON the operator writes into `--pool-profile` is what the runtime parses, and a
bad profile is a ValueError that names what is wrong (the runtime turns it into exit 2 before loading a model)."""

from __future__ import annotations

import json

import pytest

from hpi_contracts.pool_profile import PoolProfile, parse_pool_profile, pool_profile_flag, profile_from_json


def test_flag_round_trip_keeps_every_figure_and_the_source() -> None:
    profile = PoolProfile(19.4, 2.22, 760.0, 45, "assumed")
    assert parse_pool_profile(pool_profile_flag(profile)) == profile
    assert list(json.loads(pool_profile_flag(profile))) == [
        "itlAlphaMs", "itlBetaMs", "prefillTokensPerSecond", "maxNumSeqs", "source"]  # fmt: skip


def test_the_planned_slo_batch_travels_when_present_and_is_absent_otherwise() -> None:
    planned = PoolProfile(19.4, 2.22, 760.0, 45, "assumed", slo_max_num_seqs=13)
    assert parse_pool_profile(pool_profile_flag(planned)) == planned
    assert json.loads(pool_profile_flag(planned))["sloMaxNumSeqs"] == 13
    assert "sloMaxNumSeqs" not in json.loads(pool_profile_flag(PoolProfile(19.4, 2.22, 760.0, 45)))
    raw = {"itlAlphaMs": 1, "itlBetaMs": 0, "prefillTokensPerSecond": 10, "maxNumSeqs": 8, "sloMaxNumSeqs": None}
    assert profile_from_json(raw).slo_max_num_seqs is None


def test_step_time_and_per_sequence_speed_follow_the_decode_line() -> None:
    profile = PoolProfile(20.0, 2.5, 700.0, 32)
    assert profile.step_ms(4) == pytest.approx(30.0)
    assert profile.tokens_per_s_per_sequence(4) == pytest.approx(1000 / 30)
    assert profile.tokens_per_s_per_sequence(0) == profile.tokens_per_s_per_sequence(1)  # an idle pool: batch 1


def test_source_defaults_to_measured_and_accepts_a_whole_float_batch() -> None:
    raw = {"itlAlphaMs": 1, "itlBetaMs": 0, "prefillTokensPerSecond": 10, "maxNumSeqs": 8.0}
    assert profile_from_json(raw) == PoolProfile(1.0, 0.0, 10.0, 8, "measured")
    assert profile_from_json(raw, default_source="override").source == "override"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[1, 2]", "an object"),
        ('{"itlAlphaMs": 1, "itlBetaMs": 1}', "needs prefillTokensPerSecond, maxNumSeqs"),
        ('{"itlAlphaMs": "fast", "itlBetaMs": 1, "prefillTokensPerSecond": 1, "maxNumSeqs": 1}', "must be numbers"),
        ('{"itlAlphaMs": 0, "itlBetaMs": 0, "prefillTokensPerSecond": 1, "maxNumSeqs": 1}', "not both 0"),
        ('{"itlAlphaMs": 1, "itlBetaMs": 1, "prefillTokensPerSecond": 0, "maxNumSeqs": 1}', "> 0"),
        ('{"itlAlphaMs": 1, "itlBetaMs": 1, "prefillTokensPerSecond": 1, "maxNumSeqs": 1.5}', "whole number"),
        ('{"itlAlphaMs": 1, "itlBetaMs": 1, "prefillTokensPerSecond": 1, "maxNumSeqs": 0}', ">= 1"),
        ('{"itlAlphaMs": 1, "itlBetaMs": 1, "prefillTokensPerSecond": 1, "maxNumSeqs": 1, "source": "guess"}',
         "source must be one of"),
        ('{"itlAlphaMs": NaN, "itlBetaMs": 1, "prefillTokensPerSecond": 1, "maxNumSeqs": 1}', "finite"),
        ('{"itlAlphaMs": 1, "itlBetaMs": 1, "prefillTokensPerSecond": 1, "maxNumSeqs": 1, "sloMaxNumSeqs": 0}',
         "sloMaxNumSeqs must be >= 1"),
        ('{"itlAlphaMs": 1, "itlBetaMs": 1, "prefillTokensPerSecond": 1, "maxNumSeqs": 1, "sloMaxNumSeqs": 2.5}',
         "sloMaxNumSeqs must be a whole number"),
    ],
)
def test_bad_profiles_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pool_profile(text)
