"""The fleet optimizer's state on the resource: status.autoscaling.optimizer holds its last decision (replicas
per pool, which the plan runs), the demand it planned for, whether the SLO is attainable and why not, the SLO
attainment the pods observed, and its memory (per-pool recommendations for the stabilization windows, each pod's
counters and latency histograms at the last poll).
Kept on the cluster, so a restarted operator decides as the old one would have."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..autoscaling.decision import Buckets
from ..fleet.attainment import histograms_from_status
from ..fleet.demand import Counters
from ..fleet.forecast import Trend
from ..fleet.stabilize import Recommendations


@dataclass(frozen=True)
class OptimizerMemory:
    recommendations: Mapping[str, Recommendations]  # per pool
    counters: Mapping[str, Counters]  # per pod
    at_s: float | None  # the last poll
    mix: tuple[float, float] | None  # the last measured (prompt, output) tokens per request
    histograms: Mapping[str, tuple[Buckets, Buckets]] = field(default_factory=dict)  # per pod: (TTFT, TPOT)
    trend: Trend | None = None  # the demand's smoothed level and slope (fleet/forecast.py)
    start_s: Mapping[str, float] = field(default_factory=dict)  # per pool: its pods' start time (fleet/forecast.py)


def _optimizer(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    autoscaling = (status or {}).get("autoscaling")
    optimizer = autoscaling.get("optimizer") if isinstance(autoscaling, Mapping) else None
    return optimizer if isinstance(optimizer, Mapping) else {}


def optimizer_replicas(status: Mapping[str, Any] | None) -> dict[str, int] | None:
    """The replicas per pool the optimizer last chose; None before its first decision."""
    replicas = _optimizer(status).get("replicas")
    if not isinstance(replicas, Mapping):
        return None
    try:
        return {str(pool): max(int(n), 0) for pool, n in replicas.items()}
    except (TypeError, ValueError):
        return None  # a hand-mangled status: start over from spec.replicas


def optimizer_slo_batches(status: Mapping[str, Any] | None) -> dict[str, int]:
    """Per pool, the SLO batch the optimizer last planned (status.autoscaling.optimizer.pools[].sloMaxNumSeqs),
    which the pool's profile ConfigMap hands the router; empty before its first decision."""
    pools = _optimizer(status).get("pools")
    out: dict[str, int] = {}
    for pool, entry in (pools.items() if isinstance(pools, Mapping) else ()):
        value = entry.get("sloMaxNumSeqs") if isinstance(entry, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            out[str(pool)] = value
    return out


def optimizer_memory(status: Mapping[str, Any] | None) -> OptimizerMemory:
    raw = _optimizer(status)
    try:
        recommendations = {str(p): tuple((float(at), int(n)) for at, n in recs)
                           for p, recs in (raw.get("recommendations") or {}).items()}  # fmt: skip
        counters = {str(pod): tuple(float(v) for v in values)  # type: ignore[misc]
                    for pod, values in (raw.get("counters") or {}).items() if len(values) in (3, 4)}  # fmt: skip
        at_s = float(raw["lastPollEpoch"]) if raw.get("lastPollEpoch") is not None else None
        mix_raw = raw.get("tokenMix")
        mix = (float(mix_raw[0]), float(mix_raw[1])) if mix_raw else None
    except (TypeError, ValueError, KeyError, IndexError):
        return OptimizerMemory({}, {}, None, None)  # unreadable: decide afresh
    return OptimizerMemory(recommendations, counters, at_s, mix, histograms_from_status(raw.get("histograms")),  # type: ignore[arg-type]
                           _trend(raw.get("trend")), _start_s(raw.get("startSeconds")))  # fmt: skip


def trend_to_status(trend: Trend) -> list[float]:
    return [round(trend.level, 6), round(trend.slope, 8), round(trend.at_s, 3)]


def _trend(raw: Any) -> Trend | None:
    try:
        level, slope, at_s = (float(v) for v in raw)
    except (TypeError, ValueError):
        return None  # absent (an older operator's status) or mangled: the trend starts again
    return Trend(level, slope, at_s)



def _start_s(raw: Any) -> dict[str, float]:
    if not isinstance(raw, Mapping):
        return {}  # absent (an older operator's status): measured again from the ready pods
    out = {}
    for pool, seconds in raw.items():
        try:
            value = float(seconds)
        except (TypeError, ValueError):
            continue  # a mangled entry is measured again
        if math.isfinite(value) and value >= 0:
            out[str(pool)] = value
    return out
