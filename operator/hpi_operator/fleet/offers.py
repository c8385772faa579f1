"""The pools a Plan serves from, as the optimizer sees them: each pool's performance (the spec's figures, else
an estimate from the GPU's published figures, fleet/assumed.py; what a profiling Job measured on the pool's node
kind wins over the estimate), its price (the spec's costPerHour, else its nodes' price labels, fleet/pricing.py)
and its replica bounds. A pool without a price or without performance is left out, with the reason, and keeps its
minimum replicas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..profiles import PoolChoice
from ..sizing import ModelShape
from ..spec import InferenceSpec
from .assumed import assumed_performance
from .optimizer import PoolOffer
from .performance import Demand, PoolPerformance
from .pricing import LabelPrice


@dataclass(frozen=True)
class Offers:
    offers: tuple[PoolOffer, ...]
    left_out: Mapping[str, str]  # pool -> why the optimizer cannot use it
    bounds: Mapping[str, tuple[int, int]]  # every serving pool's [min, max] replicas


def pool_offers(spec: InferenceSpec, serving: Sequence[PoolChoice], shape: ModelShape, demand: Demand,
                *, label_prices: Mapping[str, LabelPrice] | None = None,
                measured: Mapping[str, PoolPerformance] | None = None) -> Offers:  # fmt: skip
    """`serving`: the plan's pools with a profile (eligible, ranked); `label_prices`: per pool, from its nodes;
    `measured`: the figures profiling Jobs measured on the pools' node kinds (profiling.py). Per pool: the spec's
    override, else measured, else assumed."""
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
        elif (cost := _cost(settings.cost_per_hour, (label_prices or {}).get(choice.pool.name))) is None:
            label = (label_prices or {}).get(choice.pool.name)
            ignored = f" ({'; '.join(label.ignored)})" if label is not None and label.ignored else ""
            left_out[choice.pool.name] = ("no price: set spec.placement.pools[].costPerHour or label its nodes "
                                          f"with a price per node-hour{ignored}")  # fmt: skip
        else:
            offers.append(PoolOffer(choice.pool.name, performance, cost, high, low))
    for settings in spec.placement.pools:  # a typo in a pool name must not pass silently
        if settings.name not in bounds:
            left_out[settings.name] = "spec.placement.pools names no serving pool (see status.pools)"
    return Offers(tuple(offers), left_out, bounds)


def _cost(spec_cost: float | None, label: LabelPrice | None) -> float | None:
    """The spec's price overrides the nodes' labels."""
    return spec_cost if spec_cost is not None else label.cost_per_hour if label is not None else None
