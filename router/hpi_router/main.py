"""Run the router: listen, start the backend sources and the monitor, serve, drain on SIGTERM.

Readiness is true while at least one backend is ready. On SIGTERM readiness turns false, new requests get
503, requests in flight finish within the drain timeout, and the process exits 0. An address it cannot listen on
(a host that does not resolve, a port taken) is one line in the log and exit code 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

from hpi_router.app import build_app
from hpi_router.config import RouterSettings
from hpi_router.monitor import monitor
from hpi_router.sources import BackendSource, StaticSource, run_sources
from hpi_router.state import RouterState

logger = logging.getLogger(__name__)


class ListenError(Exception):
    """The router cannot listen on the address it was given."""


def build_sources(settings: RouterSettings) -> list[BackendSource]:
    sources: list[BackendSource] = []
    if settings.backend_urls:
        sources.append(StaticSource(settings.backend_urls))
    if settings.discovery is not None:
        from hpi_router.discovery import EndpointSliceSource

        sources.append(EndpointSliceSource(settings.discovery))
    return sources


@contextlib.asynccontextmanager
async def running_router(state: RouterState, sources: list[BackendSource], host: str, port: int):
    """Serve `state` on host:port with its sources and monitor running; yields the runner's bound port."""
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    tasks = [asyncio.create_task(run_sources(sources, state.pool.apply)),
             asyncio.create_task(monitor(state.pool, state.settings, state.metrics))]
    try:
        yield runner.addresses[0][1]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()


async def serve(settings: RouterSettings, host: str, port: int) -> int:
    """Serve until SIGTERM/SIGINT; return the exit code."""
    state = RouterState(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with running_router(state, build_sources(settings), host, port) as bound_port:
            logger.info("routing on http://%s:%d", host, bound_port)
            await stop.wait()
            state.draining = True
            state.queue.close("the router is shutting down; retry (another router replica takes it)")
            logger.info("draining: waiting up to %.0f s for %d requests in flight", settings.drain_timeout_s,
                        state.in_flight)
            deadline = loop.time() + settings.drain_timeout_s
            while state.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.1)
    except ListenError as exc:
        logger.error("%s", exc)
        return 2
    logger.info("stopped")
    return 0
