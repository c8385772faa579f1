"""The router's state, one object per app: settings, the backend pool, its hash ring, metrics, HTTP client."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from aiohttp import web

from hpi_router.affinity import HashRing
from hpi_router.backends import Backend
from hpi_router.config import RouterSettings
from hpi_router.limits import TenantLimits
from hpi_router.metrics import RouterMetrics
from hpi_router.policy import Pick
from hpi_router.pool import BackendPool
from hpi_router.queue import RequestQueue
from hpi_router.tenants import TenantsFile


class RouterState:
    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.metrics = RouterMetrics()
        # The queue asks the pool for room; the pool tells the queue when room may have appeared.
        self.queue = RequestQueue(settings.queue.max_queued, settings.queue.max_wait_s, lambda p: self.pool.has_room(p),
                                  on_change=self.metrics.queue_changed)  # fmt: skip
        self.pool = BackendPool(settings.policy, on_change=self._rebuild_ring,
                                saturated_waiting=settings.queue.saturated_waiting, on_capacity=self.queue.notify,
                                reserved_slots=settings.queue.reserved_slots)
        self.ring = HashRing(())
        self.tenants = TenantsFile(Path(settings.tenants_file)) if settings.tenants_file else None
        self.limits = TenantLimits(settings.num_replicas)
        self.session: aiohttp.ClientSession | None = None  # opened on app startup, in the serving loop
        self.draining = False
        self.in_flight = 0

    def _rebuild_ring(self) -> None:
        self.ring = HashRing(self.pool.urls())
        self.metrics.refresh(self.pool.all())

    def choose(self, affinity_key: str | None, exclude: set[str], priority: int = 0,
               adapter: str | None = None) -> tuple[Backend, Pick] | None:  # fmt: skip
        """The backend for one request of `priority` (O(log n): BackendPool.choose), or None when none is ready
        outside `exclude`. The caller reports what it does with it: `pool.started(backend)`, then
        `pool.finished`."""
        walk = self.ring.walk(affinity_key) if affinity_key is not None else None
        choice = self.pool.choose(walk, exclude, priority, adapter)
        if choice is None:
            return None
        return self.pool.get(choice.url), choice

    async def open(self, _app: web.Application | None = None) -> None:
        # No total timeout: a generation may run for minutes; connecting is bounded, and a backend that
        # dies mid-request resets the connection.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.connect_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                             auto_decompress=False)

    async def close(self, _app: web.Application | None = None) -> None:
        if self.session is not None:
            await self.session.close()


STATE_KEY = web.AppKey("router_state", RouterState)
