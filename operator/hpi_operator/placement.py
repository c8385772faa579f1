"""Which pools serve, in which order, and how many replicas each gets. Pure functions.

Pools are ranked: the spec's preferredPools in their order, then GPU pools before CPU pools, higher
precision before lower, more device memory before less. Replicas fill pools in rank order up to each
pool's capacity (whole replicas its nodes' allocatable GPUs or memory can hold); replicas beyond the total
capacity go to the first pool, where they wait Pending for a cluster autoscaler to add nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .profiles import QUANTIZATION_ORDER, PoolChoice


@dataclass(frozen=True)
class Slot:
    pool_name: str
    capacity: int


def eligible_choices(choices: Sequence[PoolChoice], allowed: Sequence[str]) -> list[PoolChoice]:
    """Pools that have a profile and that the spec allows."""
    return [c for c in choices if c.profile is not None and (not allowed or c.pool.name in allowed)]


def rank_choices(choices: Sequence[PoolChoice], preferred: Sequence[str]) -> list[PoolChoice]:
    """Sort pools with a profile from most to least wanted."""

    def key(choice: PoolChoice) -> tuple[int, int, int, int, str]:
        profile = choice.profile
        assert profile is not None  # callers pass eligible choices only
        preference = preferred.index(choice.pool.name) if choice.pool.name in preferred else len(preferred)
        return (
            preference,
            0 if profile.device == "cuda" else 1,
            QUANTIZATION_ORDER.index(profile.quantization),
            -profile.memory_budget_bytes,
            choice.pool.name,
        )

    return sorted(choices, key=key)


def spread_replicas(num_replicas: int, slots: Sequence[Slot]) -> dict[str, int]:
    """Replicas per pool: fill `slots` in order up to capacity; any excess goes to the first slot."""
    if num_replicas < 0:
        raise ValueError(f"num_replicas must not be negative, got {num_replicas}")
    counts = {slot.pool_name: 0 for slot in slots}
    if not slots:
        return counts
    remaining = num_replicas
    for slot in slots:
        take = min(remaining, max(slot.capacity, 0))
        counts[slot.pool_name] += take
        remaining -= take
    counts[slots[0].pool_name] += remaining
    return counts
