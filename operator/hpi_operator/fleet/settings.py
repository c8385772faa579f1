"""What the spec says for the fleet optimizer: the latency target (spec.slo) and each pool's price, bounds and
optional measured performance (spec.placement.pools[]). Parsed here, pure; spec.py folds the ValueErrors into
SpecError with the field's path."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpi_contracts.pool_profile import profile_from_json

from .performance import PoolPerformance, Slo

_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(ms|s)$")


@dataclass(frozen=True)
class PoolSettings:
    name: str
    cost_per_hour: float | None = None  # None: not priced; the optimizer cannot use the pool
    min_replicas: int = 0
    max_replicas: int | None = None  # None: the pool's node capacity alone bounds it
    performance: PoolPerformance | None = None  # None: measured or assumed (fleet/offers.py)
    # The node label whose values are the pool's network domains (a rack, a block): a group that spans nodes
    # (manifests_lws.py) gets one domain to itself, LWS's exclusive topology. None: groups land anywhere.
    topology_key: str | None = None


def parse_duration_s(text: Any, where: str) -> float:
    match = _DURATION.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{where} must be a positive duration like 800ms or 1.5s; got {text!r}")
    value = float(match.group(1))
    return value / 1000 if match.group(2) == "ms" else value


def parse_slo(raw: Mapping[str, Any] | None) -> Slo | None:
    if not raw:
        return None
    return Slo(ttft_p90_s=parse_duration_s(raw.get("ttftP90"), "spec.slo.ttftP90"),
               itl_p90_s=parse_duration_s(raw.get("itlP90"), "spec.slo.itlP90"))  # fmt: skip


def _performance(raw: Mapping[str, Any], where: str) -> PoolPerformance:
    try:
        profile = profile_from_json({**raw, "source": "override"})  # the one parser of these figures
    except ValueError as e:
        raise ValueError(f"{where}.performance: {e}") from e
    return PoolPerformance.from_profile(profile)


def parse_pools(raw: Sequence[Mapping[str, Any]] | None) -> tuple[PoolSettings, ...]:
    pools = []
    for i, item in enumerate(raw or ()):
        where = f"spec.placement.pools[{i}]"
        name = str(item.get("name") or "")
        if not name:
            raise ValueError(f"{where}.name is required")
        cost = item.get("costPerHour")
        if cost is not None and float(cost) < 0:
            raise ValueError(f"{where}.costPerHour must not be negative; got {cost}")
        low, high = int(item.get("minReplicas") or 0), item.get("maxReplicas")
        if low < 0 or (high is not None and int(high) < low):
            raise ValueError(f"{where}: minReplicas must be >= 0 and not above maxReplicas")
        perf = item.get("performance")
        pools.append(PoolSettings(name=name, cost_per_hour=None if cost is None else float(cost), min_replicas=low,
                                  max_replicas=None if high is None else int(high),
                                  performance=_performance(perf, where) if perf else None,
                                  topology_key=str(item.get("topologyKey") or "") or None))  # fmt: skip
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ValueError("spec.placement.pools names each pool once")
    return tuple(pools)
