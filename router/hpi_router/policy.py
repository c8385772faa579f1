"""Which backend takes a request: pure functions of frozen backend views (no I/O, no clock).

Load of a backend: requests it holds = in flight through this router now (fresh) + the requests the last
scrape saw beyond this router's own at that moment (other routers' and direct clients', up to one interval
old; this router's own are never counted stale) + the scraped waiting ones once more (they have not even
started). Speed: the decode rate one request sees there (tokens/s per busy request, measured from the
generation-token counter; backends.py); before it is measured, its pool profile's figure for the batch it
runs now (ITL = alpha + beta x batch, hpi_contracts.pool_profile); with neither, the fleet's median.

Score = (load + 1) / speed, inflated as the KV cache fills past a soft limit: the time the backend needs
to work off what it holds, plus this request. Picking the lowest score keeps load proportional to speed,
so a backend twice as fast holds twice the requests. Per-request speed is used, not total tokens/s:
total throughput grows with the batch a backend is given, so weighting by it would feed the busiest backend
still more; per-request speed falls as a batch grows, which makes the estimate self-correcting.

Planned shares: when every ready backend's profile carries `sloMaxNumSeqs` (the most sequences one replica of
its pool runs within the deployment's SLO, which the operator's fleet optimizer planned the pool at), the score
is (load + 1) / sloMaxNumSeqs instead: load in proportion to each backend's capacity within the SLO, so every
pool runs at the share of it that the plan gave it. Speed alone would not: a slow replica's per-request speed
at a small batch can look as good as a fast one's at a large batch, and the speed score then fills the slow one
to its decode-speed balance, past its SLO batch, where other requests' prefills stall its decodes (a fleet of 8
GPUs beside one small GPU sent 1.2 requests/s to a small one planned for 0.7, and 89% of them missed the ITL
target; bench/results/fleet.md). A fleet with a backend the plan does not cover (no SLO, or a pod that has not
read it yet) uses speed, so the two scales never mix. Within planned shares the router still corrects online: a
backend whose measured speed, against its profile's at the batch it runs, is below the median of the backends
with the same profile (a throttled node, a noisy neighbour) has its share cut in that proportion. A whole pool
slower than its figures keeps its planned share: that is the plan's to correct, not one replica's.

The parts of a speed that depend on the whole fleet (the median default, the MIN_SPEED_FRACTION floor, the
fastest rating, the sum of ratings) form a `SpeedScale`, computed once per scrape round (O(n log n) for the
median) and fixed until the next: a pick then needs only its own backend's figures, so the pool can keep
every backend's `rank` in an index and pick in O(log n) (pool.py). `pick` below is the same decision by a
scan of every view: the specification the index is tested against, and the benchmark's baseline.

Prefix affinity (consistent hashing with bounded load, Mirrokni et al. 2018): walk the ring from the
request's key and take the first backend whose load stays within `affinity_load_factor` times its
speed-weighted share of the fleet's load (+1 for this request, rounded up, so an idle backend always has
room); if none of the first MAX_AFFINITY_PROBES does, the lowest score. Backends less than
AFFINITY_MIN_SPEED_RATIO as fast as the fastest are no affinity targets (the rounding up would hand a many
times slower backend every key it owns whenever it is idle): affinity works among replicas of comparable
speed, slower ones get only what the score sends.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from hpi_contracts.pool_profile import PoolProfile
from hpi_router.backends import BackendView
from hpi_router.config import PolicySettings

AFFINITY_MIN_SPEED_RATIO = 0.5  # an affinity target must be at least this fraction as fast as the fastest
MIN_SPEED_FRACTION = 0.05  # no backend is rated below this fraction of the fastest: it still gets tried
KV_PRESSURE_WEIGHT = 20.0  # score multiplier per unit of KV usage over the soft limit (0.9 -> x3 at 0.8)
# Distinct backends tried along the ring before the lowest score decides. A key's requests spill along the
# ring only as far as their own load pushes them, so the backends that hold its prefix are the first few;
# and at most 1/1.5 of the backends can be over a 1.5x bound at once, so eight in a row are all full less than
# (2/3)^8 = 4% of the time (if fullness were independent along the ring). Past eight, the lowest score is the
# better pick anyway. Fleets of up to eight backends try them all, as an unbounded walk would.
MAX_AFFINITY_PROBES = 8


@dataclass(frozen=True)
class Pick:
    url: str
    # "affinity" (the ring's choice), "load" (lowest score), "round_robin", or for a LoRA adapter's request (pool.py)
    # "adapter" (a backend where it is resident) or "adapter_slot" (the lowest score among those with a free slot)
    reason: str


@dataclass(frozen=True)
class SpeedScale:
    """The fleet-wide part of every speed, fixed for one scrape round."""

    default: float = 1.0  # an unmeasured backend without a profile: the median of the known speeds
    floor: float = 0.0  # MIN_SPEED_FRACTION of the fastest known: nothing is rated below it
    fastest: float = 1.0  # the highest rating (affinity's speed ratio)
    total_rating: float = 1.0  # the sum of the ratings (affinity's speed-weighted shares)
    planned: bool = False  # every backend has a planned SLO batch: scores and ratings are by it (module docstring)
    paces: Mapping[PoolProfile, float] = field(default_factory=dict)  # planned: per profile, its backends' median


def load_of(view: BackendView) -> float:
    others = max(0.0, view.num_running + view.num_waiting - view.in_flight_at_scrape)
    return view.in_flight + others + view.num_waiting


def prior_speed(view: BackendView, batch: float) -> float | None:
    """The profile's tokens/s per sequence with `batch` running; a batch never exceeds the profile's most
    sequences (beyond them requests wait, which the load already counts). None without a profile."""
    if view.profile is None:
        return None
    return view.profile.tokens_per_s_per_sequence(min(batch, view.profile.max_num_seqs))


def known_speed(view: BackendView) -> float | None:
    """Measured, else the profile's speed for a lone sequence (its best): what the fleet-wide figures use.
    A measured 0 (a stall) counts as unknown, as before profiles existed."""
    return view.decode_speed or prior_speed(view, 1.0)


def slo_batch(view: BackendView) -> int | None:
    return None if view.profile is None else view.profile.slo_max_num_seqs


def pace(view: BackendView) -> float | None:
    """Its measured speed over its profile's at the batch it runs now; None until measured or without one."""
    prior = prior_speed(view, max(view.num_running, view.in_flight))
    return view.decode_speed / prior if view.decode_speed and prior else None


def planned_share(view: BackendView, paces: Mapping[PoolProfile, float]) -> float:
    """Its SLO batch, cut in proportion when it runs slower than the median of its profile's backends (never
    below MIN_SPEED_FRACTION of it: it still gets tried, and measured again)."""
    batch = float(slo_batch(view) or 1)
    own, median = pace(view), paces.get(view.profile) if view.profile is not None else None
    if own is None or not median:
        return batch
    return batch * min(1.0, max(own / median, MIN_SPEED_FRACTION))


def speed_scale(views: Sequence[BackendView]) -> SpeedScale:
    """The round's scale over the ready backends. Without profiles: unmeasured ones count as the median of
    the measured (1.0 when none is), as the router always did. With every backend's planned SLO batch: the
    ratings are those batches, each cut by its pace against its profile's median (planned_share)."""
    if views and all(slo_batch(v) for v in views):
        by_profile: dict[PoolProfile, list[float]] = {}
        for view in views:
            if view.profile is not None and (measured := pace(view)) is not None:
                by_profile.setdefault(view.profile, []).append(measured)
        paces = {profile: statistics.median(values) for profile, values in by_profile.items()}
        shares = [planned_share(v, paces) for v in views]
        return SpeedScale(min(shares), 0.0, max(shares), math.fsum(shares), planned=True, paces=paces)
    known = [s for s in map(known_speed, views) if s]
    default = statistics.median(known) if known else 1.0
    floor = MIN_SPEED_FRACTION * max(known, default=default)
    ratings = [max(known_speed(v) or default, floor) for v in views]
    return SpeedScale(default, floor, max(ratings, default=default), math.fsum(ratings) or 1.0)


def speed_of(view: BackendView, scale: SpeedScale) -> float:
    """The speed a request sees there now: measured, else the profile's at the batch running there now."""
    busy = max(view.num_running, view.in_flight)
    return max(view.decode_speed or prior_speed(view, busy) or scale.default, scale.floor)


def rating_of(view: BackendView, scale: SpeedScale) -> float:
    """The speed affinity weighs shares by: like `speed_of`, but a profile counts at one sequence, as in the
    round's totals (a share must not shrink because the backend is busy). Planned: its planned_share."""
    if scale.planned:
        return planned_share(view, scale.paces)
    return max(known_speed(view) or scale.default, scale.floor)


def score(view: BackendView, speed: float, settings: PolicySettings) -> float:
    pressure = 1.0 + KV_PRESSURE_WEIGHT * max(0.0, view.kv_usage - settings.kv_usage_soft_limit)
    return (load_of(view) + 1.0) / speed * pressure


def rank(view: BackendView, scale: SpeedScale, settings: PolicySettings) -> tuple:
    """The order backends are picked in, lowest first: by score, ties to the one picked least often, then by
    URL (a total order, so the pick is deterministic); round-robin: least often picked first."""
    if settings.strategy == "round-robin":
        return (view.num_picks, view.url)
    speed = rating_of(view, scale) if scale.planned else speed_of(view, scale)
    return (score(view, speed, settings), view.num_picks, view.url)


def affinity_fits(view: BackendView, scale: SpeedScale, fleet_load: float, settings: PolicySettings) -> bool:
    """Whether a backend on the key's ring path may take the request: fast enough, and under its bound.
    `fleet_load`: the sum of `load_of` over the ready backends."""
    rating = rating_of(view, scale)
    if rating < AFFINITY_MIN_SPEED_RATIO * scale.fastest:
        return False
    bound = math.ceil(settings.affinity_load_factor * (fleet_load + 1.0) * rating / scale.total_rating)
    return load_of(view) + 1.0 <= bound


def pick(views: Sequence[BackendView], ring_order: Sequence[str] | None, settings: PolicySettings,
         exclude: Collection[str] = (), scale: SpeedScale | None = None) -> Pick | None:
    """The backend for one request among `views` (the ready ones), or None if all are excluded, by a scan.

    `scale`: the round's; None computes it from `views`. Fleet-wide figures (scale, fleet load) cover all of
    `views`; `exclude` (a retry's backends already tried) only removes candidates."""
    candidates = [v for v in views if v.url not in exclude]
    if not candidates:
        return None
    scale = speed_scale(views) if scale is None else scale
    if settings.strategy == "round-robin":
        return Pick(min(candidates, key=lambda v: rank(v, scale, settings)).url, "round_robin")
    if ring_order:
        by_url = {v.url: v for v in candidates}
        fleet_load = math.fsum(load_of(v) for v in views)
        for url in ring_order[:MAX_AFFINITY_PROBES]:
            view = by_url.get(url)
            if view is not None and affinity_fits(view, scale, fleet_load, settings):
                return Pick(url, "affinity")
    best = min(candidates, key=lambda v: rank(v, scale, settings))
    return Pick(best.url, "load")
