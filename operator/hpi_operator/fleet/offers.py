"""The pools a Plan serves from, as the optimizer sees them: each pool's performance (the spec's figures, else
what a profiling Job measured on the pool's node kind, else an estimate from the GPU's published figures,
fleet/assumed.py), its price and its replica bounds. A pool without a price or without performance is left out,
with the reason, and keeps its minimum replicas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..profiles import PoolChoice
from ..sizing import ModelShape
from ..spec import InferenceSpec
from .assumed import assumed_performance
from .optimizer import PoolOffer
from .performance import Demand, PoolPerformance


@dataclass(frozen=True)
class Offers:
    offers: tuple[PoolOffer, ...]
    left_out: Mapping[str, str]  # pool -> why the optimizer cannot use it
    bounds: Mapping[str, tuple[int, int]]  # every serving pool's [min, max] replicas


def pool_offers(spec: InferenceSpec, serving: Sequence[PoolChoice], shape: ModelShape, demand: Demand,
                measured: Mapping[str, PoolPerformance] | None = None) -> Offers:  # fmt: skip
    """`serving`: the plan's pools with a profile (eligible, ranked); `measured`: the figures profiling Jobs measured
    on the pools' node kinds (profiling.py). Per pool: the spec's override, else measured, else assumed."""
    context = demand.mean_prompt_tokens + demand.mean_output_tokens / 2
    offers, left_out, bounds = [], {}, {}
    for choice in serving:
        assert choice.profile is not None  # serving pools have a profile
        settings = spec.placement.pool(choice.pool.name)
        high = choice.capacity if settings.max_replicas is None else min(choice.capacity, settings.max_replicas)
        low = min(settings.min_replicas, high)
        bounds[choice.pool.name] = (low, high)
        performance = (settings.performance or (measured or {}).get(choice.pool.name)
                       or assumed_performance(choice.pool.gpu_product, choice.profile, shape, context))  # fmt: skip
        if performance is None:
            left_out[choice.pool.name] = ("no performance figures: set spec.placement.pools[].performance, or let "
                                          "spec.placement.profiling measure the pool")  # fmt: skip
        elif settings.cost_per_hour is None:
            left_out[choice.pool.name] = "no price: set spec.placement.pools[].costPerHour"
        else:
            offers.append(PoolOffer(choice.pool.name, performance, settings.cost_per_hour, high, low))
    for settings in spec.placement.pools:  # a typo in a pool name must not pass silently
        if settings.name not in bounds:
            left_out[settings.name] = "spec.placement.pools names no serving pool (see status.pools)"
    return Offers(tuple(offers), left_out, bounds)
