"""The running fleet: replicas per pool through their life (starting -> ready -> draining -> gone) and what they
cost. A replica is paid for from the moment it is asked for (its node is held while the pod starts) until it has
drained. Scale-down drains the newest replicas first (those still starting go at once, as a Deployment deletes
unready pods first); a draining replica takes no new requests and finishes the ones it holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .pools import SimPool
from .replica import Replica

STATES = ("starting", "ready", "draining")


@dataclass
class Member:
    replica: Replica
    pool: str
    created_s: float
    ready_at_s: float
    state: str = "starting"  # starting | ready | draining


@dataclass
class Fleet:
    pools: Sequence[SimPool]
    members: dict[str, Member] = field(default_factory=dict)
    cost: float = 0.0  # dollars so far
    cost_by_state: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATES, 0.0))
    _cost_at_s: float = 0.0
    _serial: int = 0

    def __post_init__(self) -> None:
        self.by_name = {p.name: p for p in self.pools}

    def _account(self, now_s: float) -> None:
        """Cost accrues per live member per second, at its pool's price (and is kept by the member's state)."""
        if now_s > self._cost_at_s:
            hours = (now_s - self._cost_at_s) / 3600
            for m in self.members.values():
                dollars = self.by_name[m.pool].cost_per_hour * hours
                self.cost_by_state[m.state] += dollars
                self.cost += dollars
            self._cost_at_s = now_s

    def replicas(self, pool: str | None = None, states: tuple[str, ...] = ("starting", "ready")) -> list[Member]:
        return [m for m in self.members.values() if m.state in states and (pool is None or m.pool == pool)]

    def counts(self) -> dict[str, int]:
        """Replicas per pool that the controller counts as current (starting or ready, not draining)."""
        return {p.name: len(self.replicas(p.name)) for p in self.pools}

    def ready(self) -> list[Member]:
        return self.replicas(states=("ready",))

    def scale_to(self, target: Mapping[str, int], now_s: float) -> tuple[list[Member], list[Member]]:
        """Start or drain replicas so each pool has `target` current ones. Returns (started, draining)."""
        self._account(now_s)
        started, draining = [], []
        for pool in self.pools:
            current = self.replicas(pool.name)
            want = max(0, min(target.get(pool.name, len(current)), pool.max_replicas))
            for _ in range(want - len(current)):
                self._serial += 1
                name = f"{pool.name}-{self._serial}"
                member = Member(Replica(name, pool.engine), pool.name, now_s, now_s + pool.cold_start_s)
                self.members[name] = member
                started.append(member)
            if want < len(current):
                newest_first = sorted(current, key=lambda m: (m.state == "ready", -m.created_s))
                for member in newest_first[: len(current) - want]:
                    member.state = "draining"
                    draining.append(member)
        return started, draining

    def mark_ready(self, name: str, now_s: float) -> bool:
        member = self.members.get(name)
        if member is None or member.state != "starting":
            return False
        self._account(now_s)
        member.state = "ready"
        return True

    def retire_idle_drainers(self, now_s: float) -> list[str]:
        """Draining replicas with nothing left to do leave (and stop costing)."""
        self._account(now_s)
        gone = [n for n, m in self.members.items() if m.state == "draining" and not m.replica.busy]
        for name in gone:
            del self.members[name]
        return gone

    def cost_until(self, now_s: float) -> float:
        self._account(now_s)
        return self.cost
