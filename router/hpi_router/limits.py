"""Per-tenant limits in this router replica: requests in flight, and requests and tokens per minute over a sliding
window. Each replica enforces its share of the tenant's fleet-wide limits (tenants.Limits.share).

A request over a limit is refused before it queues (429 with Retry-After and OpenAI's error shape): a tenant at
its limit must not take queue places from the others. Tokens are known only once an answer ends (its usage,
usage.py), so a request is admitted while the tenant's last minute is under its token limit, and its tokens count
when it ends: a tenant can go over by what its requests in flight use, then waits until enough of the minute
has passed.
"""

from __future__ import annotations

import math
from collections import deque

from hpi_router.tenants import Limits, Tenant

WINDOW_S = 60.0


class LimitExceeded(Exception):
    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


def _retry_after_s(expiry_s: float, now_s: float) -> int:
    return max(1, math.ceil(expiry_s - now_s))


class TenantLimits:
    def __init__(self, num_replicas: int = 1) -> None:
        if num_replicas < 1:
            raise ValueError(f"router replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self._in_flight: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {}  # per tenant: when its last requests were admitted
        self._tokens: dict[str, deque[tuple[float, int]]] = {}  # per tenant: (when, tokens) of its ended answers

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def tokens_in_window(self, tenant: str, now_s: float) -> int:
        used = self._tokens.get(tenant, deque())
        while used and used[0][0] <= now_s - WINDOW_S:
            used.popleft()
        return sum(n for _, n in used)

    def limits_of(self, tenant: Tenant) -> Limits:
        return tenant.limits.share(self.num_replicas)

    def admit(self, tenant: Tenant, now_s: float) -> None:
        """Count one request of `tenant` in, or raise LimitExceeded (then nothing is counted)."""
        limits, name = self.limits_of(tenant), tenant.name
        if limits.concurrent_requests is not None and self.in_flight(name) >= limits.concurrent_requests:
            raise LimitExceeded(f"tenant {name!r} has {limits.concurrent_requests} requests in flight, its limit "
                                "here; retry when one ends", 1)  # fmt: skip
        recent = self._recent.setdefault(name, deque())
        while recent and recent[0] <= now_s - WINDOW_S:
            recent.popleft()
        if limits.requests_per_minute is not None and len(recent) >= limits.requests_per_minute:
            wait = _retry_after_s(recent[0] + WINDOW_S, now_s)
            raise LimitExceeded(f"tenant {name!r} sent {limits.requests_per_minute} requests in the last minute, "
                                f"its limit here; retry in {wait} s", wait)  # fmt: skip
        if limits.tokens_per_minute is not None:
            used = self.tokens_in_window(name, now_s)
            if used >= limits.tokens_per_minute:
                wait = _retry_after_s(self._freed_at(name, used - limits.tokens_per_minute + 1), now_s)
                raise LimitExceeded(f"tenant {name!r} used {used} tokens in the last minute, over its limit of "
                                    f"{limits.tokens_per_minute} here; retry in {wait} s", wait)  # fmt: skip
        recent.append(now_s)
        self._in_flight[name] = self.in_flight(name) + 1

    def _freed_at(self, tenant: str, num_tokens: int) -> float:
        """When at least `num_tokens` (no more than the window holds) will have left the tenant's window."""
        for when_s, n in self._tokens[tenant]:
            num_tokens -= n
            if num_tokens <= 0:
                return when_s + WINDOW_S
        raise AssertionError("asked for more tokens than the window holds")

    def record_tokens(self, tenant: Tenant, num_tokens: int, now_s: float) -> None:
        """An answer of `tenant` ended having used `num_tokens` (prompt + completion)."""
        if num_tokens > 0:
            self._tokens.setdefault(tenant.name, deque()).append((now_s, num_tokens))

    def release(self, tenant: Tenant) -> None:
        """One request of `tenant` ended (answered, refused later, or gone)."""
        left = self.in_flight(tenant.name) - 1
        if left > 0:
            self._in_flight[tenant.name] = left
        else:
            self._in_flight.pop(tenant.name, None)
