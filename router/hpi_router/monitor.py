"""Keeps each backend's view fresh: scrapes /metrics of ready backends every `scrape_interval_s`, probes
/ready of ejected (and new) ones every `probe_interval_s` and lets them back in when it answers 200.

A scrape that fails to connect, times out or shows `hpi:ready 0` (a draining or dead runtime) ejects the
backend; a /metrics page without vLLM's names (some other OpenAI server) only means no load signals.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from hpi_router.backends import Backend
from hpi_router.config import RouterSettings
from hpi_router.metrics import RouterMetrics
from hpi_router.pool import BackendPool
from hpi_router.signals import parse_metrics

logger = logging.getLogger(__name__)


def eject(pool: BackendPool, backend: Backend, reason: str, metrics: RouterMetrics) -> None:
    if pool.eject(backend, reason):
        metrics.ejections.labels(backend.url).inc()
        logger.warning("ejected %s: %s", backend.url, reason)


async def _scrape(session: aiohttp.ClientSession, pool: BackendPool, backend: Backend,
                  metrics: RouterMetrics) -> None:
    try:
        async with session.get(f"{backend.url}/metrics") as response:
            if response.status != 200:
                if response.status >= 500:
                    eject(pool, backend, f"/metrics answered {response.status}", metrics)
                return
            text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        eject(pool, backend, f"/metrics failed: {type(exc).__name__}: {exc}", metrics)
        return
    try:
        sample = parse_metrics(text)
    except ValueError as exc:
        logger.debug("unparsable /metrics from %s: %s", backend.url, exc)
        return
    if sample.ready is False:
        eject(pool, backend, "hpi:ready is 0 (loading, draining or failed)", metrics)
        return
    pool.observe(backend, sample)


async def _probe(session: aiohttp.ClientSession, pool: BackendPool, backend: Backend) -> None:
    try:
        async with session.get(f"{backend.url}/ready") as response:
            ok = response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        ok = False
    if ok:
        pool.restore(backend)
        logger.info("backend %s is ready", backend.url)


async def monitor(pool: BackendPool, settings: RouterSettings, metrics: RouterMetrics) -> None:
    """Run until cancelled."""
    timeout = aiohttp.ClientTimeout(total=settings.scrape_timeout_s)
    next_probe: dict[str, float] = {}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            now = time.monotonic()
            jobs = []
            for backend in pool.all():
                if backend.ready:
                    next_probe.pop(backend.url, None)
                    jobs.append(_scrape(session, pool, backend, metrics))
                elif now >= next_probe.get(backend.url, 0.0):
                    next_probe[backend.url] = now + settings.probe_interval_s
                    jobs.append(_probe(session, pool, backend))
            await asyncio.gather(*jobs)
            pool.rescale()  # the round's fleet-wide speed scale: once per round, not per request
            metrics.refresh(pool.all())
            await asyncio.sleep(max(0.0, settings.scrape_interval_s - (time.monotonic() - now)))
