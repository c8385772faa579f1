"""The optimizer's per-pool recommendation turned into replicas that do not flap: the HorizontalPodAutoscaler's
rules (as the KV-utilisation scaler applies them, autoscaling/decision.py), per pool.

- up: the lowest recommendation within the scale-up window (a spike must last the window);
- down: the highest recommendation within the scale-down window (a dip must last the window);
- at most `max_step` replicas added or removed per pool per decision;
- within the pool's bounds [min, max].
The recommendations are the memory: kept per pool, on the resource (status), pruned past the longest window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Recommendations = tuple[tuple[float, int], ...]  # (epoch seconds, replicas), oldest first


@dataclass(frozen=True)
class Window:
    scale_up_s: float
    scale_down_s: float
    max_step: int


def remember(history: Recommendations, now_s: float, replicas: int, window: Window) -> Recommendations:
    horizon = max(window.scale_up_s, window.scale_down_s)
    return (*((at, n) for at, n in history if now_s - at <= horizon), (now_s, replicas))


def stabilized(current: int, history: Recommendations, now_s: float, window: Window, low: int, high: int) -> int:
    """The replicas to run now, given the recommendations (the latest included) and the current replicas."""
    latest = history[-1][1]
    if latest > current:
        within = [n for at, n in history if now_s - at <= window.scale_up_s]
        target = max(min(within), current)
        target = min(target, current + window.max_step)
    elif latest < current:
        within = [n for at, n in history if now_s - at <= window.scale_down_s]
        target = min(max(within), current)
        target = max(target, current - window.max_step)
    else:
        target = current
    return max(low, min(high, target))


def stabilize_all(
    current: Mapping[str, int],
    recommended: Mapping[str, int],
    histories: Mapping[str, Sequence[tuple[float, int]]],
    bounds: Mapping[str, tuple[int, int]],
    now_s: float,
    window: Window,
) -> tuple[dict[str, int], dict[str, Recommendations]]:
    """Per pool: the stabilized replicas and the updated recommendation memory."""
    replicas, memory = {}, {}
    for pool, wanted in recommended.items():
        history = remember(tuple(tuple(p) for p in histories.get(pool, ())), now_s, wanted, window)  # type: ignore[misc]
        low, high = bounds.get(pool, (0, wanted))
        replicas[pool] = stabilized(current.get(pool, 0), history, now_s, window, low, high)
        memory[pool] = history
    return replicas, memory
