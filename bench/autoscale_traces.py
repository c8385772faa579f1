"""Replay synthetic load traces through the builtin autoscaler's decision function and compare it with an
oracle, fixed replica counts, a plain HPA-style scaler on the same KV metric, and a naive CPU-style scaler.

    .venv/bin/python bench/autoscale_traces.py            # all traces, table + replicas over time
    .venv/bin/python bench/autoscale_traces.py --quick    # shorter traces (what the test runs)

The pod model (one second per step):
- demand is in "KV units": one unit fills one replica's KV cache. Each ready replica carries demand / ready,
  so its KV utilisation is min(1, demand / ready); beyond 1 the excess waits in the queue
  (SEQS_PER_UNIT requests per unit) and latency SLOs are missed;
- a new replica takes STARTUP_S to load the model before it is ready; a removed one goes at once;
- SLO attainment: the fraction of seconds in which per-replica utilisation stays under SATURATION
  (an idle, empty deployment meets it; demand with no ready replica does not);
- the oracle runs, every second and with no start-up delay, the fewest replicas that keep utilisation at
  the target: ceil(demand / target). Over-provisioned replica-seconds are those above it, under-provisioned
  the ready replicas missing below it; both are reported as a fraction of the oracle's replica-seconds.
Scalers: builtin (hpi_operator.autoscale.decide, 15 s polls); hpa-kv (the HPA algorithm on the same KV
metric: 15 s sync, 10% tolerance, 300 s scale-down window, default policies of +max(100%, 4 pods) per 15 s,
and no notion that a full KV cache hides demand); cpu-naive (the HPA algorithm on CPU, which for an LLM pod
sits near one busy core whenever any request runs, because the engine loop never sleeps); fixed at the mean
and at the peak of the oracle.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from hpi_operator.autoscaling.decision import History, Observation, PodLoad, decide
from hpi_operator.spec import AutoscalingSpec

STARTUP_S = 90
SATURATION = 0.9
SEQS_PER_UNIT = 32
TARGET = 0.7
MIN_REPLICAS, MAX_REPLICAS = 1, 16
SYNC_S = 15

Trace = Callable[[int], float]  # second -> demand in KV units


# -- traces ---------------------------------------------------------------------------------------------------


def diurnal(length_s: int, seed: int = 1) -> list[float]:
    """A day compressed into `length_s`: night trough 0.5 units, afternoon peak 9, with minute-scale noise."""
    rng = random.Random(seed)
    noise, out = 0.0, []
    for t in range(length_s):
        if t % 60 == 0:
            noise = rng.gauss(0, 0.25)
        base = 0.5 + 8.5 * (1 - math.cos(2 * math.pi * t / length_s)) / 2
        out.append(max(0.0, base * (1 + noise * 0.2)))
    return out


def bursty(length_s: int, seed: int = 2) -> list[float]:
    """A base of 2 units with bursts to 7-10 units lasting 2-5 minutes, about every 15 minutes."""
    rng = random.Random(seed)
    out = [2.0] * length_s
    t = rng.randint(120, 600)
    while t < length_s:
        height, width = rng.uniform(7, 10), rng.randint(120, 300)
        for s in range(t, min(length_s, t + width)):
            out[s] = height
        t += width + rng.randint(500, 1100)
    return out


def ramp(length_s: int) -> list[float]:
    """Up from 0.3 to 9 units over 40% of the trace, hold for 20%, back down over 40%."""
    up, hold = int(length_s * 0.4), int(length_s * 0.2)
    out = []
    for t in range(length_s):
        if t < up:
            out.append(0.3 + 8.7 * t / up)
        elif t < up + hold:
            out.append(9.0)
        else:
            out.append(max(0.3, 9.0 - 8.7 * (t - up - hold) / (length_s - up - hold)))
    return out


def sparse(length_s: int, seed: int = 3) -> list[float]:
    """Mostly idle, with busy half hours: the case for scale-to-zero."""
    rng = random.Random(seed)
    out = [0.0] * length_s
    t = 600
    while t < length_s:
        width = rng.randint(600, 1800)
        for s in range(t, min(length_s, t + width)):
            out[s] = 2.5
        t += width + rng.randint(1800, 3600)
    return out


# -- the pods -----------------------------------------------------------------------------------------------


@dataclass
class Pods:
    started_at: list[int] = field(default_factory=list)

    def count(self) -> int:
        return len(self.started_at)

    def ready(self, t: int) -> int:
        return sum(1 for s in self.started_at if t - s >= STARTUP_S)

    def scale(self, desired: int, t: int) -> None:
        self.started_at.sort()
        while len(self.started_at) > desired:
            self.started_at.pop()  # the newest (still starting) first, as a ReplicaSet does
        while len(self.started_at) < desired:
            self.started_at.append(t)


def per_pod(demand: float, ready: int) -> tuple[float, float, float]:
    """(KV utilisation, waiting, running) of each ready pod."""
    if ready == 0:
        return 0.0, 0.0, 0.0
    kv = min(1.0, demand / ready)
    waiting = max(0.0, demand - ready) * SEQS_PER_UNIT / ready
    return kv, waiting, kv * SEQS_PER_UNIT


# -- scalers: (t, current, demand, pods) -> desired ---------------------------------------------------------


class Builtin:
    name = "builtin"

    def __init__(self, spec: AutoscalingSpec) -> None:
        self.spec, self.history = spec, History()

    def __call__(self, t: int, current: int, demand: float, pods: Pods) -> int:
        if t % self.spec.poll_interval_s:
            return current
        ready = pods.ready(t)
        kv, waiting, running = per_pod(demand, ready)
        loads = tuple(PodLoad(f"p{i}", kv, waiting, running) for i in range(ready))
        # At zero replicas a gateway holds the requests: they are the wake-up signal.
        external = int(demand * SEQS_PER_UNIT) if ready == 0 and demand > 0 else 0
        d = decide(self.spec, current, Observation(loads, 0, external), self.history, float(t))
        self.history = d.history
        return d.desired_replicas


class HpaStyle:
    """The HPA's replica calculation and default behavior (k8s.io/kubernetes pkg/controller/podautoscaler)."""

    def __init__(self, name: str, metric: Callable[[float, int], float], target: float) -> None:
        self.name, self.metric, self.target = name, metric, target
        self.recs: list[tuple[int, int]] = []

    def __call__(self, t: int, current: int, demand: float, pods: Pods) -> int:
        if t % SYNC_S:
            return current
        ready = pods.ready(t)
        if ready == 0:
            raw = current
        else:
            ratio = self.metric(demand, ready) / self.target
            raw = current if abs(ratio - 1) <= 0.1 else math.ceil(ratio * ready)
            if ratio > 1:
                raw = max(raw, current)  # unready pods count as 0 on scale-up: never down while above target
        self.recs = [(s, r) for s, r in self.recs if s > t - 300] + [(t, raw)]
        # the HPA's scale-down stabilization: never below the highest recommendation of the last 300 s
        stabilized = min(current, max(r for _, r in self.recs)) if raw < current else raw
        up_limit = max(2 * current, current + 4)
        return max(MIN_REPLICAS, min(MAX_REPLICAS, up_limit, stabilized))


class Fixed:
    def __init__(self, name: str, replicas: int) -> None:
        self.name, self.replicas = name, replicas

    def __call__(self, t: int, current: int, demand: float, pods: Pods) -> int:
        return self.replicas


def kv_metric(demand: float, ready: int) -> float:
    return per_pod(demand, ready)[0]


def cpu_metric(demand: float, ready: int) -> float:
    return 1.0 if demand > 0 else 0.02  # the engine loop keeps a core busy whenever a request runs


# -- the simulation ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    scaler: str
    slo: float  # fraction of seconds under SATURATION
    replica_s: float
    oracle_replica_s: float
    over_s: float
    under_s: float
    num_scale_events: int
    timeline: tuple[int, ...]  # replicas at each sample

    @property
    def cost_ratio(self) -> float:
        return self.replica_s / self.oracle_replica_s

    @property
    def over_ratio(self) -> float:
        return self.over_s / self.oracle_replica_s

    @property
    def under_ratio(self) -> float:
        return self.under_s / self.oracle_replica_s


def oracle(demand: float) -> int:
    return math.ceil(demand / TARGET - 1e-9) if demand > 0 else 0


def simulate(scaler: Callable[[int, int, float, Pods], int], demand: list[float], start: int,
             sample_s: int) -> Result:  # fmt: skip
    pods = Pods()
    pods.started_at = [-STARTUP_S] * start  # already warm
    ok = replica_s = oracle_s = over = under = 0.0
    events, timeline = 0, []
    for t, units in enumerate(demand):
        desired = scaler(t, pods.count(), units, pods)
        if desired != pods.count():
            events += 1
            pods.scale(desired, t)
        ready = pods.ready(t)
        ok += (units == 0) or (ready > 0 and units / ready <= SATURATION)
        replica_s += pods.count()
        best = oracle(units)
        oracle_s += best
        over += max(0, pods.count() - best)
        under += max(0, best - ready)
        if t % sample_s == 0:
            timeline.append(pods.count())
    return Result(getattr(scaler, "name", "?"), ok / len(demand), replica_s, max(oracle_s, 1.0), over, under,
                  events, tuple(timeline))  # fmt: skip


def builtin_spec(scale_to_zero: bool = False) -> AutoscalingSpec:
    return AutoscalingSpec(
        enabled=True, min_replicas=0 if scale_to_zero else MIN_REPLICAS, max_replicas=MAX_REPLICAS,
        target_kv_utilization=TARGET, scale_down_stabilization_s=300, max_scale_step=3, poll_interval_s=SYNC_S,
        scale_to_zero=scale_to_zero, scale_to_zero_idle_s=300,
    )  # fmt: skip


def run_trace(demand: list[float], sample_s: int, scale_to_zero: bool = False) -> list[Result]:
    oracle_replicas = [oracle(u) for u in demand]
    mean_fixed = max(1, round(sum(oracle_replicas) / len(oracle_replicas)))
    peak_fixed = max(1, max(oracle_replicas))
    start = max(1, oracle_replicas[0])
    scalers = [
        Builtin(builtin_spec(scale_to_zero)),
        HpaStyle("hpa-kv", kv_metric, TARGET),
        HpaStyle("cpu-naive", cpu_metric, TARGET),
        Fixed(f"fixed-mean({mean_fixed})", mean_fixed),
        Fixed(f"fixed-peak({peak_fixed})", peak_fixed),
    ]
    return [simulate(s, demand, start, sample_s) for s in scalers]


TRACES = {"diurnal": diurnal, "bursty": bursty, "ramp": ramp, "sparse": sparse}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1-hour traces instead of 4-hour ones")
    args = parser.parse_args(argv)
    length = 3600 if args.quick else 4 * 3600
    sample = length // 24
    for name, make in TRACES.items():
        demand = make(length)
        results = run_trace(demand, sample, scale_to_zero=name == "sparse")
        print(f"\n== {name} ({length // 60} min, start-up {STARTUP_S}s, target {TARGET:.0%}, "
              f"SLO: utilisation <= {SATURATION:.0%}){' scale-to-zero' if name == 'sparse' else ''}")  # fmt: skip
        print(f"{'scaler':<16}{'SLO':>7}{'replica-h':>11}{'cost/oracle':>13}{'over/oracle':>13}{'under/oracle':>14}"
              f"{'scalings':>10}")  # fmt: skip
        for r in results:
            print(f"{r.scaler:<16}{r.slo:>7.1%}{r.replica_s / 3600:>11.1f}{r.cost_ratio:>13.2f}{r.over_ratio:>13.2f}"
                  f"{r.under_ratio:>14.3f}{r.num_scale_events:>10}")  # fmt: skip
        print(f"{'oracle':<16}{'':>7}{results[0].oracle_replica_s / 3600:>11.1f}")
        oracle_line = [oracle(demand[t]) for t in range(0, length, sample)]
        print(f"{'replicas':<16}every {sample // 60} min")
        print(f"  {'oracle':<14}{' '.join(f'{n:>2}' for n in oracle_line)}")
        for r in results[:3]:
            print(f"  {r.scaler:<14}{' '.join(f'{n:>2}' for n in r.timeline)}")


if __name__ == "__main__":
    main()
