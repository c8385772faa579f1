"""Observed SLO attainment from the pods' histograms: Prometheus' histogram_quantile, the conservative union bound,
per-pod diffs between polls, and the scrape reading the buckets. Every expected figure is worked out by hand in
the comment beside it."""

from __future__ import annotations

import math

import pytest

from hpi_operator.autoscaling.decision import PodLoad
from hpi_operator.autoscaling.fleet_status import optimizer_memory
from hpi_operator.autoscaling.scrape import parse_load
from hpi_operator.fleet.attainment import (
    attainment_lower_bound,
    diff,
    histogram_quantile,
    histograms_from_status,
    histograms_to_status,
    merge,
    num_over,
    read_latency,
)
from hpi_operator.fleet.performance import Slo

INF = math.inf
# 100 requests: 60 with TTFT <= 0.5 s, 25 more <= 1 s, 10 more <= 2.5 s, 5 above.
TTFT = ((0.5, 60.0), (1.0, 85.0), (2.5, 95.0), (INF, 100.0))
# 90 of them had two or more tokens: 50 with mean ITL <= 50 ms, 30 more <= 100 ms, 10 above.
TPOT = ((0.05, 50.0), (0.1, 80.0), (INF, 90.0))


def test_the_p90_interpolates_linearly_inside_the_bucket_that_holds_the_rank() -> None:
    # rank 90 lies in (1.0, 2.5] which holds samples 86..95: 1.0 + 1.5 x (90 - 85) / 10 = 1.75
    assert histogram_quantile(0.9, TTFT) == pytest.approx(1.75)
    # rank 9 of 10 in the first bucket: from 0 to 0.1, 9/10 of the way
    assert histogram_quantile(0.9, ((0.1, 10.0), (INF, 10.0))) == pytest.approx(0.09)
    # rank 81 of 90 lies in +Inf: Prometheus answers the last finite bound
    assert histogram_quantile(0.9, TPOT) == pytest.approx(0.1)
    assert histogram_quantile(0.9, ((0.1, 0.0), (INF, 0.0))) is None  # no sample, no quantile


def test_a_bucket_that_straddles_the_target_counts_as_missing() -> None:
    assert num_over(1.0, TTFT) == 15  # a bound at the target: exactly the 15 above 1 s
    assert num_over(0.8, TTFT) == 40  # 0.8 s falls inside (0.5, 1.0]: all 25 of it count as over
    assert num_over(0.1, TPOT) == 10
    assert num_over(0.01, TPOT) == 90  # below the first bound: nothing is known to be within


def test_attainment_is_the_union_bound_over_requests() -> None:
    # 1 - (15 over TTFT + 10 over mean ITL) / 100 requests
    assert attainment_lower_bound(Slo(1.0, 0.1), TTFT, TPOT) == pytest.approx(0.75)
    # 1 - (40 + 10) / 100: the straddling bucket makes the bound lower, never higher
    assert attainment_lower_bound(Slo(0.8, 0.1), TTFT, TPOT) == pytest.approx(0.5)
    assert attainment_lower_bound(Slo(0.01, 0.01), TTFT, TPOT) == 0.0  # 190 "misses" of 100: clamped
    assert attainment_lower_bound(Slo(1.0, 0.1), ((1.0, 0.0), (INF, 0.0)), ()) is None


def test_polls_diff_each_pods_buckets_and_sum_over_pods() -> None:
    before = ((1.0, 10.0), (INF, 12.0))
    assert diff(((1.0, 15.0), (INF, 20.0)), before) == ((1.0, 5.0), (INF, 8.0))
    assert diff(((1.0, 1.0), (INF, 1.0)), before) is None  # a count went back: the pod restarted
    assert diff(((2.0, 15.0), (INF, 20.0)), before) is None  # other bounds: not comparable
    other = ((2.0, 100.0), (INF, 100.0))  # another bound set with more samples wins the sum alone
    assert merge([before, before]) == ((1.0, 20.0), (INF, 24.0))
    assert merge([before, before, other]) == other


def load(pod: str, scale: float) -> PodLoad:
    ttft = tuple((le, n * scale) for le, n in TTFT)
    tpot = tuple((le, n * scale) for le, n in TPOT)
    return PodLoad(pod, 0.2, ttft_buckets=ttft, tpot_buckets=tpot)


def test_read_latency_reports_the_window_since_the_last_poll() -> None:
    slo = Slo(1.0, 0.1)
    first = read_latency([load("a", 1)], {}, None, slo)
    assert first.observed is None and set(first.histograms) == {"a"}
    # a grew from 1x to 3x the hand-made histograms (200 requests), b is new: only a counts this time
    second = read_latency([load("a", 3), load("b", 5)], first.histograms, 10.0, slo)
    observed = second.observed
    assert observed is not None and observed.requests == 200 and observed.window_s == 10.0
    assert observed.attainment == pytest.approx(0.75) and observed.ttft_p90_s == pytest.approx(1.75)
    assert observed.itl_p90_s == pytest.approx(0.1)
    idle = read_latency([load("a", 3)], second.histograms, 10.0, slo).observed
    assert idle is not None and idle.requests == 0 and idle.attainment is None


def test_the_buckets_survive_the_status_round_trip_with_the_bounds_written_once() -> None:
    other = ((2.0, 1.0), (INF, 1.0))
    written = histograms_to_status({"a": (TTFT, TPOT), "b": (TTFT, TPOT), "c": (other, TPOT)})
    assert written == {"bounds": {"ttft": [0.5, 1.0, 2.5], "tpot": [0.05, 0.1]},
                       "pods": {"a": [[60.0, 85.0, 95.0, 100.0], [50.0, 80.0, 90.0]],
                                "b": [[60.0, 85.0, 95.0, 100.0], [50.0, 80.0, 90.0]]}}  # c: other bounds  # fmt: skip
    assert histograms_from_status(written) == {"a": (TTFT, TPOT), "b": (TTFT, TPOT)}
    written["pods"]["b"] = [[1.0, 2.0], [1.0]]  # mangled: a count short
    assert optimizer_memory({"autoscaling": {"optimizer": {"histograms": written}}}).histograms == {"a": (TTFT, TPOT)}
    assert histograms_from_status("garbage") == {} and histograms_to_status({}) is None


def test_the_scrape_reads_both_histograms_and_drops_one_that_reads_badly() -> None:
    text = ('# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            'vllm:time_to_first_token_seconds_bucket{model_name="m",le="0.5"} 3.0\n'
            'vllm:time_to_first_token_seconds_bucket{model_name="m",le="+Inf"} 4.0\n'
            'vllm:time_to_first_token_seconds_count{model_name="m"} 4.0\n'
            'vllm:time_to_first_token_seconds_sum{model_name="m"} 1.0\n'
            "# TYPE vllm:request_time_per_output_token_seconds histogram\n"
            'vllm:request_time_per_output_token_seconds_bucket{model_name="m",le="0.1"} 5.0\n'
            'vllm:request_time_per_output_token_seconds_bucket{model_name="m",le="+Inf"} 4.0\n'
            'vllm:request_time_per_output_token_seconds_count{model_name="m"} 4.0\n'
            'vllm:request_time_per_output_token_seconds_sum{model_name="m"} 0.2\n')  # fmt: skip
    parsed = parse_load("p", text, "m")
    assert parsed.ttft_buckets == ((0.5, 3.0), (INF, 4.0))
    assert parsed.tpot_buckets is None  # 5 then 4: not cumulative; the KV load still reads
    assert parsed.kv_utilization == 0.5
