"""Which backend takes a request: a pure function of frozen backend views (no I/O, no clock).

Load of a backend: requests it holds = in flight through this router now (fresh) + the requests the last
scrape saw beyond this router's own at that moment (other routers' and direct clients', up to one interval
old; this router's own are never counted stale) + the scraped waiting ones once more (they have not even
started). Speed: the decode rate one request sees there (tokens/s per busy request, measured from the
generation-token counter; backends.py).

Score = (load + 1) / speed, inflated as the KV cache fills past a soft limit: the time the backend needs
to work off what it holds, plus this request. Picking the lowest score keeps load proportional to speed,
so a backend twice as fast holds twice the requests. Per-request speed is used, not total tokens/s:
total throughput grows with the batch a backend is given, so weighting by it would feed the busiest backend
still more; per-request speed falls as a batch grows, which makes the estimate self-correcting.

Prefix affinity (consistent hashing with bounded load, Mirrokni et al. 2018): walk the ring from the
request's key and take the first backend whose load stays within `affinity_load_factor` times its
speed-weighted share of the fleet's load (+1 for this request, rounded up, so an idle backend always has
room); if none does, the lowest score. Backends less than AFFINITY_MIN_SPEED_RATIO as fast as the fastest
are no affinity targets (the rounding up would hand a many times slower backend every key it owns whenever
it is idle): affinity works among replicas of comparable speed, slower ones get only what the score sends.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from hpi_router.backends import BackendView
from hpi_router.config import PolicySettings

AFFINITY_MIN_SPEED_RATIO = 0.5  # an affinity target must be at least this fraction as fast as the fastest
MIN_SPEED_FRACTION = 0.05  # no backend is rated below this fraction of the fastest: it still gets tried
KV_PRESSURE_WEIGHT = 20.0  # score multiplier per unit of KV usage over the soft limit (0.9 -> x3 at 0.8)


@dataclass(frozen=True)
class Pick:
    url: str
    reason: str  # "affinity" (the ring's choice), "load" (lowest score) or "round_robin"


def load_of(view: BackendView) -> float:
    others = max(0.0, view.num_running + view.num_waiting - view.in_flight_at_scrape)
    return view.in_flight + others + view.num_waiting


def speeds(views: Sequence[BackendView]) -> dict[str, float]:
    """Each backend's speed; unmeasured ones get the median of the measured (1.0 when none is)."""
    measured = [v.decode_speed for v in views if v.decode_speed]
    default = statistics.median(measured) if measured else 1.0
    floor = MIN_SPEED_FRACTION * max(measured, default=default)
    return {v.url: max(v.decode_speed or default, floor) for v in views}


def score(view: BackendView, speed: float, settings: PolicySettings) -> float:
    pressure = 1.0 + KV_PRESSURE_WEIGHT * max(0.0, view.kv_usage - settings.kv_usage_soft_limit)
    return (load_of(view) + 1.0) / speed * pressure


def pick(views: Sequence[BackendView], ring_order: Sequence[str] | None, settings: PolicySettings,
         exclude: Collection[str] = ()) -> Pick | None:
    """The backend for one request among `views` (the ready ones), or None if all are excluded."""
    candidates = [v for v in views if v.url not in exclude]
    if not candidates:
        return None
    if settings.strategy == "round-robin":
        return Pick(min(candidates, key=lambda v: (v.num_picks, v.url)).url, "round_robin")
    speed = speeds(candidates)
    if ring_order:
        by_url = {v.url: v for v in candidates}
        total_load = sum(load_of(v) for v in candidates) + 1.0
        total_speed = sum(speed.values())
        min_speed = AFFINITY_MIN_SPEED_RATIO * max(speed.values())
        for url in ring_order:
            view = by_url.get(url)
            if view is None or speed[url] < min_speed:
                continue
            bound = math.ceil(settings.affinity_load_factor * total_load * speed[url] / total_speed)
            if load_of(view) + 1.0 <= bound:
                return Pick(url, "affinity")
    best = min(candidates, key=lambda v: (score(v, speed[v.url], settings), v.num_picks, v.url))
    return Pick(best.url, "load")
