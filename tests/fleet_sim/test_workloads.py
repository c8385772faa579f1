"""Seeded workloads: the same seed gives the same stream, the fits keep their published medians, the diurnal
rate peaks mid-run."""

from __future__ import annotations

import statistics

from fleet_sim.workloads import AZURE_CONV_2023, Arrivals, generate


def test_same_seed_same_stream():
    arrivals = Arrivals("mmpp", 20.0, 120.0)
    assert generate(arrivals, AZURE_CONV_2023, 7) == generate(arrivals, AZURE_CONV_2023, 7)
    assert generate(arrivals, AZURE_CONV_2023, 7) != generate(arrivals, AZURE_CONV_2023, 8)


def test_the_azure_fit_keeps_its_medians():
    requests = generate(Arrivals("poisson", 200.0, 60.0), AZURE_CONV_2023, 1)
    assert abs(statistics.median(r.prompt_tokens for r in requests) / 1020 - 1) < 0.05
    assert abs(statistics.median(r.output_tokens for r in requests) / 129 - 1) < 0.08


def test_the_diurnal_day_peaks_in_the_middle():
    arrivals = Arrivals("diurnal", 50.0, 600.0, trough_fraction=0.2)
    times = [r.arrival_s for r in generate(arrivals, AZURE_CONV_2023, 2)]
    night = sum(1 for t in times if t < 100 or t >= 500)
    noon = sum(1 for t in times if 250 <= t < 350)
    assert noon > 2 * night / 2  # per 100 s, the peak carries more than twice the night
    assert arrivals.diurnal_rate(300.0) == 50.0 and arrivals.diurnal_rate(0.0) == 10.0


def test_the_headline_day_stretches_to_its_length():
    """`--day-hours`: the same diurnal shape and peak over a longer day, so about that many times the requests,
    spread over the whole of it."""
    from fleet_sim import scenarios

    one = scenarios.day(3, scale=0.01)
    four = scenarios.day(3, scale=0.01, day_s=4 * scenarios.DURATION_S)
    assert 3.6 < len(four) / len(one) < 4.4
    assert max(r.arrival_s for r in one) < scenarios.DURATION_S < max(r.arrival_s for r in four)
    assert max(r.arrival_s for r in four) < 4 * scenarios.DURATION_S
