"""The trace simulation (bench/autoscale_traces.py) as a regression check: pods whose KV utilisation follows
load / replicas with a start-up delay, replayed through the builtin decision and the baselines."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "autoscale_traces.py"
LENGTH_S = 3600


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("autoscale_traces", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def results(bench: ModuleType) -> dict[str, dict[str, object]]:
    out = {}
    for name, make in bench.TRACES.items():
        runs = bench.run_trace(make(LENGTH_S), LENGTH_S // 24, scale_to_zero=name == "sparse")
        out[name] = {r.scaler.split("(")[0]: r for r in runs}
    return out


def test_builtin_tracks_smooth_load_close_to_the_oracle(results) -> None:
    for trace in ("diurnal", "ramp"):
        builtin = results[trace]["builtin"]
        assert builtin.slo >= 0.95, trace
        assert builtin.cost_ratio <= 1.2, trace  # within 20% of the replica-seconds of a clairvoyant scaler
        assert builtin.slo > results[trace]["fixed-mean"].slo + 0.2


def test_bursts_are_met_better_than_by_the_plain_hpa_on_the_same_metric(results) -> None:
    bursty = results["bursty"]
    assert bursty["builtin"].slo > bursty["hpa-kv"].slo + 0.02  # the queue reveals demand a full KV cache hides
    assert bursty["builtin"].under_ratio < bursty["hpa-kv"].under_ratio


def test_never_the_cost_of_cpu_scaling_or_peak_provisioning(results) -> None:
    for trace, runs in results.items():
        assert runs["builtin"].cost_ratio < runs["cpu-naive"].cost_ratio, trace
        assert runs["builtin"].cost_ratio < runs["fixed-peak"].cost_ratio, trace


def test_scale_to_zero_saves_idle_replica_seconds(results) -> None:
    sparse = results["sparse"]
    assert sparse["builtin"].cost_ratio < sparse["hpa-kv"].cost_ratio  # the HPA keeps one replica all night
    assert 0 in sparse["builtin"].timeline
    assert sparse["builtin"].slo >= sparse["hpa-kv"].slo - 0.01  # waking costs only the start-up delay


def test_hpa_baseline_holds_replicas_through_its_scale_down_window(bench: ModuleType) -> None:
    hpa = bench.HpaStyle("hpa-kv", bench.kv_metric, bench.TARGET)
    pods = bench.Pods()
    pods.started_at = [-bench.STARTUP_S] * 5
    assert hpa(0, 5, 5 * bench.TARGET, pods) == 5  # at target: recommends 5
    assert hpa(bench.SYNC_S, 5, 0.5, pods) == 5  # load gone, but 5 was recommended inside the window
    assert hpa(300 + bench.SYNC_S, 5, 0.5, pods) == 1  # the window has passed: down to what the load needs


def test_bench_prints_a_report(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--quick"])
    out = capsys.readouterr().out
    assert out.count("== ") == 4 and "cost/oracle" in out and "replica-h" in out
