"""Per-tenant limits in this router replica: requests in flight, and requests per minute over a sliding window.

A request over a limit is refused before it queues (429 with Retry-After and OpenAI's error shape): a tenant at
its limit must not take queue places from the others. Counts are per replica (tenants.Limits says why).
"""

from __future__ import annotations

import math
from collections import deque

from hpi_router.tenants import Tenant

WINDOW_S = 60.0


class LimitExceeded(Exception):
    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


class TenantLimits:
    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._recent: dict[str, deque[float]] = {}  # per tenant: when its last requests were admitted

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def admit(self, tenant: Tenant, now_s: float) -> None:
        """Count one request of `tenant` in, or raise LimitExceeded (then nothing is counted)."""
        limits = tenant.limits
        if limits.concurrent_requests is not None and self.in_flight(tenant.name) >= limits.concurrent_requests:
            raise LimitExceeded(f"tenant {tenant.name!r} has {limits.concurrent_requests} requests in flight, its "
                                "limit; retry when one ends", 1)  # fmt: skip
        if limits.requests_per_minute is not None:
            recent = self._recent.setdefault(tenant.name, deque())
            while recent and recent[0] <= now_s - WINDOW_S:
                recent.popleft()
            if len(recent) >= limits.requests_per_minute:
                wait = max(1, math.ceil(recent[0] + WINDOW_S - now_s))
                raise LimitExceeded(f"tenant {tenant.name!r} sent {limits.requests_per_minute} requests in the last "
                                    f"minute, its limit; retry in {wait} s", wait)  # fmt: skip
            recent.append(now_s)
        self._in_flight[tenant.name] = self.in_flight(tenant.name) + 1

    def release(self, tenant: Tenant) -> None:
        """One request of `tenant` ended (answered, refused later, or gone)."""
        left = self.in_flight(tenant.name) - 1
        if left > 0:
            self._in_flight[tenant.name] = left
        else:
            self._in_flight.pop(tenant.name, None)
