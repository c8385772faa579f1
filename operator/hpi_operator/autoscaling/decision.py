"""The builtin autoscaler's decision: a pure function of the settings, the pods' KV-cache load, the persisted
history and the time. No I/O; the kopf timer (loop.py) reads, calls `decide`, and writes.

The algorithm is the HorizontalPodAutoscaler's, on KV-cache utilisation instead of CPU:
1. raw recommendation: ceil(sum of ready pods' KV utilisation / target), left at the current replicas inside
   a tolerance band around the target; on saturation (a pod's KV cache nearly full) or a waiting queue the
   true demand is hidden (the engine queues instead of using more KV), so it is at least ready pods + step;
2. stabilization: the highest raw recommendation within the scale-down window and the lowest within the
   scale-up window bound the move (so a dip must last a whole window before replicas go, and load that
   oscillates around the target never flaps);
3. never down while any ready pod's metrics are missing (an unreadable pod is not an idle pod);
4. at most `max_scale_step` replicas per decision, then min/max; zero only after the idle window.

The memory (the windows' recommendations, the last scale and the last activity) is a `History` that the
operator keeps in the resource's status (`history_to_status` / `history_from_status`), so a restarted
operator decides exactly as the old one would have.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..spec import AutoscalingSpec

TOLERANCE = 0.1  # the HPA's default: no change while utilisation is within 10% of the target
SATURATION_KV = 0.95  # a pod this full admits no new sequences: its real demand is unknown (censored)
_EPS = 1e-9  # float noise must not add a replica: ceil(2.0000000001) would

# A Prometheus histogram's cumulative buckets: (upper bound `le`, samples at or below it), ascending, the last
# bound +Inf (its count is the histogram's _count).
Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class PodLoad:
    """One ready pod whose /metrics was read."""

    pod: str
    kv_utilization: float  # vllm:kv_cache_usage_perc, 0..1
    num_waiting: float = 0.0  # vllm:num_requests_waiting
    num_running: float = 0.0  # vllm:num_requests_running
    # The pod's counters since it started (None where the pod does not export them): the fleet optimizer's
    # demand is their growth between polls.
    num_finished: float | None = None  # vllm:request_success_total, all finish reasons
    prompt_tokens: float | None = None  # vllm:prompt_tokens_total
    generation_tokens: float | None = None  # vllm:generation_tokens_total
    # The latency histograms since the pod started (None where absent): the optimizer's observed SLO attainment.
    ttft_buckets: Buckets | None = None  # vllm:time_to_first_token_seconds
    tpot_buckets: Buckets | None = None  # vllm:request_time_per_output_token_seconds (per-request mean ITL)
    # How the pod started (hpi:startup_phase_seconds{phase}, hpi:startup_seconds); empty / None where absent.
    startup_phases: tuple[tuple[str, float], ...] = ()
    startup_s: float | None = None

    @property
    def idle(self) -> bool:
        return self.num_waiting <= 0 and self.num_running <= 0


@dataclass(frozen=True)
class Observation:
    """What one poll saw."""

    loads: tuple[PodLoad, ...] = ()
    num_failed: int = 0  # ready pods whose /metrics was unreachable or unparsable: load unknown
    num_external_waiting: int = 0  # demand seen outside the pods (a gateway, a wake annotation): wakes from zero

    @property
    def num_ready(self) -> int:
        return len(self.loads) + self.num_failed

    @property
    def mean_kv_utilization(self) -> float | None:
        return sum(p.kv_utilization for p in self.loads) / len(self.loads) if self.loads else None

    @property
    def num_waiting(self) -> float:
        return sum(p.num_waiting for p in self.loads)


@dataclass(frozen=True)
class Recommendation:
    at_s: float  # wall-clock (epoch) seconds: it must survive an operator restart
    replicas: int


@dataclass(frozen=True)
class History:
    """The autoscaler's memory between polls, persisted on the resource.

    The windows are kept as monotonic queues (the classic sliding-window max/min): `window_max` holds
    recommendations in time order with strictly decreasing replicas (its head is the maximum over the
    scale-down window), `window_min` strictly increasing ones (its head is the minimum over the scale-up
    window). A recommendation that a later, higher (lower) one dominates can never be the window's maximum
    (minimum) again, so it is dropped: each queue holds at most max distinct values, however long the window.
    """

    window_max: tuple[Recommendation, ...] = ()
    window_min: tuple[Recommendation, ...] = ()
    last_scale_s: float | None = None
    last_scale_up_s: float | None = None
    last_active_s: float | None = None  # last poll that saw a running or waiting request (or could not tell)


@dataclass(frozen=True)
class Decision:
    desired_replicas: int
    reason: str  # CamelCase, for status and Events
    message: str
    history: History
    raw_replicas: int  # the recommendation before stabilization, step and bounds
    kv_utilization: float | None  # mean over the pods that were read
    num_ready: int
    num_failed: int


def _ceil(value: float) -> int:
    return max(0, math.ceil(value - _EPS))


def _push_max(queue: Sequence[Recommendation], rec: Recommendation, horizon_s: float) -> tuple[Recommendation, ...]:
    kept = [r for r in queue if r.at_s > horizon_s and r.replicas > rec.replicas]
    return (*kept, rec)


def _push_min(queue: Sequence[Recommendation], rec: Recommendation, horizon_s: float) -> tuple[Recommendation, ...]:
    kept = [r for r in queue if r.at_s > horizon_s and r.replicas < rec.replicas]
    return (*kept, rec)


def _raw_recommendation(
    settings: AutoscalingSpec, current: int, obs: Observation, idle_for_s: float | None
) -> tuple[int, str]:
    """The replicas this poll alone asks for, and why (before stabilization, step and bounds)."""
    if current == 0:
        if obs.num_external_waiting > 0 or obs.num_waiting > 0:
            return max(settings.min_replicas, 1), f"{obs.num_external_waiting or obs.num_waiting:g} waiting request(s)"
        return 0, "scaled to zero and no request is waiting"
    if not obs.loads:
        if obs.num_failed:
            return current, f"no metrics: {obs.num_failed} ready pod(s) unreachable or unparsable"
        return current, "no ready pod yet"
    if (
        settings.scale_to_zero
        and idle_for_s is not None
        and idle_for_s >= settings.scale_to_zero_idle_s
        and obs.num_failed == 0
    ):
        return 0, f"no request for {idle_for_s:.0f}s (scale-to-zero after {settings.scale_to_zero_idle_s}s)"
    mean = obs.mean_kv_utilization or 0.0
    target = settings.target_kv_utilization
    # Unreadable pods are assumed to carry the mean: neither zero (which would scale down) nor full.
    total = mean * obs.num_ready
    ratio = mean / target
    if abs(ratio - 1.0) <= TOLERANCE:
        proportional, why = current, f"KV {mean:.0%} within {TOLERANCE:.0%} of target {target:.0%}"
    elif ratio > 1.0:
        # Never a scale-down while above target (pods still starting make ceil(total/target) < current).
        proportional, why = max(current, _ceil(total / target)), f"KV {mean:.0%} above target {target:.0%}"
    else:
        proportional, why = min(current, _ceil(total / target)), f"KV {mean:.0%} below target {target:.0%}"
    candidates = [(proportional, why)]
    saturated = [p.pod for p in obs.loads if p.kv_utilization >= SATURATION_KV]
    if saturated:
        candidates.append((obs.num_ready + settings.max_scale_step, f"KV saturated on {len(saturated)} pod(s)"))
    waiting = obs.num_waiting
    target_waiting = settings.target_waiting_requests
    if target_waiting and waiting / len(obs.loads) > target_waiting:
        candidates.append((_ceil(waiting * obs.num_ready / len(obs.loads) / target_waiting),
                           f"{waiting:g} waiting requests over target {target_waiting} per pod"))  # fmt: skip
    elif waiting > 0 and not target_waiting:
        candidates.append(_queue_recommendation(settings, obs))
    return max(candidates, key=lambda c: c[0])


def _queue_recommendation(settings: AutoscalingSpec, obs: Observation) -> tuple[int, str]:
    """A queue means the KV signal is censored: estimate the demand as KV in use plus the KV the queued
    requests would take (as much each as a running request takes now), and ask for at least one more pod."""
    running = sum(p.num_running for p in obs.loads)
    kv_in_use = sum(p.kv_utilization for p in obs.loads)
    if running <= 0 or kv_in_use <= 0:
        return obs.num_ready + settings.max_scale_step, f"{obs.num_waiting:g} request(s) waiting, none running"
    queued_kv = obs.num_waiting * kv_in_use / running
    estimate = (kv_in_use + queued_kv) * obs.num_ready / len(obs.loads)
    replicas = max(obs.num_ready + 1, _ceil(estimate / settings.target_kv_utilization))
    return replicas, f"{obs.num_waiting:g} request(s) waiting: ~{estimate:.1f} replicas' worth of KV demand"


def decide(settings: AutoscalingSpec, current: int, obs: Observation, history: History, now_s: float) -> Decision:
    """The replicas to run now, why, and the history to persist for the next poll."""
    active = (
        history.last_active_s is None  # no memory (first poll): start the idle clock now
        or obs.num_failed > 0
        or obs.num_external_waiting > 0
        or any(not p.idle for p in obs.loads)
    )
    last_active_s = now_s if active else history.last_active_s
    idle_for_s = None if last_active_s is None else now_s - last_active_s
    raw, why = _raw_recommendation(settings, current, obs, idle_for_s)

    rec = Recommendation(now_s, raw)
    down_s = settings.scale_down_window_s()
    window_max = _push_max(history.window_max, rec, now_s - down_s)
    window_min = _push_min(history.window_min, rec, now_s - settings.scale_up_stabilization_s)
    highest = max(r.replicas for r in window_max)  # over the scale-down window
    lowest = min(r.replicas for r in window_min)  # over the scale-up window
    stabilized = min(max(current, lowest), highest)
    notes = []
    if raw < current and stabilized > raw:
        notes.append(f"held: {highest} recommended within the {down_s:g}s scale-down window")
    elif raw > current and stabilized < raw:
        notes.append(f"held: {lowest} recommended within the {settings.scale_up_stabilization_s}s scale-up window")

    if stabilized < current and obs.num_failed > 0:
        stabilized = current
        notes.append(f"scale-down blocked: {obs.num_failed} pod(s) unreachable or unparsable")
    if (
        stabilized < current
        and history.last_scale_up_s is not None
        and now_s - history.last_scale_up_s < down_s
    ):
        stabilized = current  # the cooldown after a scale-up: its pods have not had a window to take load
        notes.append("scale-down waits for the window after the last scale-up")

    step = settings.max_scale_step
    stepped = max(current - step, min(current + step, stabilized))
    if stepped != stabilized:
        notes.append(f"limited to {step} replica(s) per step")

    zero_allowed = settings.scale_to_zero and (
        (current == 0 and raw == 0) or (raw == 0 and idle_for_s is not None
                                        and idle_for_s >= settings.scale_to_zero_idle_s)
    )  # fmt: skip
    floor = 0 if zero_allowed else max(settings.min_replicas, 1)
    desired = max(floor, min(settings.max_replicas, stepped))
    if desired != stepped:
        notes.append(f"clamped to [{floor}, {settings.max_replicas}]")

    if desired > current:
        reason = "ScaledFromZero" if current == 0 else "ScaledUp"
    elif desired < current:
        reason = "ScaledToZero" if desired == 0 else "ScaledDown"
    elif obs.num_failed and current:
        reason = "MetricsMissing"
    else:
        reason = "Steady"
    message = f"{current} -> {desired}: {why}" + "".join(f"; {n}" for n in notes)
    scaled = desired != current
    new_history = replace(
        history,
        window_max=window_max,
        window_min=window_min,
        last_scale_s=now_s if scaled else history.last_scale_s,
        last_scale_up_s=now_s if desired > current else history.last_scale_up_s,
        last_active_s=last_active_s,
    )
    return Decision(
        desired_replicas=desired,
        reason=reason,
        message=message,
        history=new_history,
        raw_replicas=raw,
        kv_utilization=obs.mean_kv_utilization,
        num_ready=obs.num_ready,
        num_failed=obs.num_failed,
    )


# -- the resource representation ------------------------------------------------------------------------------


def _pairs(recs: Sequence[Recommendation]) -> list[list[float | int]]:
    return [[_time(r.at_s), r.replicas] for r in recs]


def _time(at_s: float) -> float | int:
    return int(at_s) if float(at_s).is_integer() else round(at_s, 3)


def history_to_status(history: History) -> dict[str, Any]:
    """The keys of `status.autoscaling` that carry the memory (JSON-safe; epoch seconds)."""
    out: dict[str, Any] = {"windowMax": _pairs(history.window_max), "windowMin": _pairs(history.window_min)}
    for key, value in (
        ("lastScaleEpoch", history.last_scale_s),
        ("lastScaleUpEpoch", history.last_scale_up_s),
        ("lastActiveEpoch", history.last_active_s),
    ):
        out[key] = None if value is None else _time(value)
    return out


def _recs(raw: Any) -> tuple[Recommendation, ...]:
    recs = []
    for item in raw if isinstance(raw, list) else ():
        if isinstance(item, list) and len(item) == 2:
            try:
                recs.append(Recommendation(float(item[0]), int(item[1])))
            except (TypeError, ValueError):
                continue
    return tuple(sorted(recs, key=lambda r: r.at_s))


def _epoch(raw: Any) -> float | None:
    try:
        return None if raw is None else float(raw)
    except (TypeError, ValueError):
        return None


def history_from_status(status_autoscaling: Mapping[str, Any] | None) -> History:
    """Inverse of `history_to_status`; whatever is missing or mangled reads as no memory (never raises)."""
    raw = status_autoscaling if isinstance(status_autoscaling, Mapping) else {}
    return History(
        window_max=_recs(raw.get("windowMax")),
        window_min=_recs(raw.get("windowMin")),
        last_scale_s=_epoch(raw.get("lastScaleEpoch")),
        last_scale_up_s=_epoch(raw.get("lastScaleUpEpoch")),
        last_active_s=_epoch(raw.get("lastActiveEpoch")),
    )
