"""The router's queue as demand: hpi-router holds requests while no backend can take them (none ready, as when a
pool sits at zero, or every ready one saturated) and exports how many per flow as `hpi:router_queued_requests`.
The runtime pods cannot show those requests (there may be no pod at all), so the autoscaler scrapes the ready
router pods of the InferenceDeployment and sums the gauge over them: the queued demand.

A pure parser of one router's exposition, an async scrape of all router pods (the runtime scrape's fetch, its
timeout and its failure kinds), and the status keys that report both. A router that does not answer, or whose
page lacks the gauge, contributes nothing and is reported, never a crash: an older router image has no queue.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from hpi_contracts.metrics import ROUTER_QUEUED_REQUESTS

from .scrape import DEFAULT_TIMEOUT_S, UNPARSABLE, MetricsParseError, PodTarget, ScrapeFailed, fetch_metrics

MAX_REPORTED_FAILURES = 10
_EPS = 1e-9  # float noise in a sum of per-flow gauges must not add a request


@dataclass(frozen=True)
class RouterQueue:
    """One poll of the router pods: the requests they hold (summed), how many were asked, which failed."""

    num_queued: int = 0  # over the router pods that answered with the gauge
    num_routers: int = 0  # ready router pods asked; 0: no router (another routing mode, or none ready)
    failed: tuple[ScrapeFailed, ...] = ()


def parse_router_queued(text: str) -> float:
    """A router's /metrics text -> the requests it holds, summed over its flows (tenant, priority).

    The gauge declared with no sample is an idle router (a labelled gauge prints samples only for flows it has
    seen): zero. Raises MetricsParseError when the text is not Prometheus exposition format, lacks the gauge
    (a router without a queue, or not a router), or a sample is not a finite, non-negative count."""
    found, values = False, []
    try:
        for family in text_string_to_metric_families(text):
            if family.name != ROUTER_QUEUED_REQUESTS:
                continue
            found = True
            values += [float(s.value) for s in family.samples if s.name == ROUTER_QUEUED_REQUESTS]
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise MetricsParseError(f"not Prometheus text: {e}") from e
    if not found:
        raise MetricsParseError(f"no {ROUTER_QUEUED_REQUESTS} gauge")
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise MetricsParseError(f"{ROUTER_QUEUED_REQUESTS} is not a finite, non-negative count: {values}")
    return sum(values)


async def _scrape_router(session: aiohttp.ClientSession, target: PodTarget, timeout_s: float
                         ) -> float | ScrapeFailed:  # fmt: skip
    text = await fetch_metrics(session, target, timeout_s)
    if isinstance(text, ScrapeFailed):
        return text
    try:
        return parse_router_queued(text)
    except MetricsParseError as e:
        return ScrapeFailed(target.pod, UNPARSABLE, str(e))


async def scrape_router_queue(
    targets: Sequence[PodTarget], timeout_s: float = DEFAULT_TIMEOUT_S, session: aiohttp.ClientSession | None = None
) -> RouterQueue:
    """Scrape every ready router pod concurrently and sum what they hold."""
    if not targets:
        return RouterQueue()
    if session is None:
        async with aiohttp.ClientSession() as own:
            return await scrape_router_queue(targets, timeout_s, own)
    results = await asyncio.gather(*(_scrape_router(session, t, timeout_s) for t in targets))
    queued = sum(r for r in results if not isinstance(r, ScrapeFailed))
    failed = tuple(r for r in results if isinstance(r, ScrapeFailed))
    return RouterQueue(max(0, math.ceil(queued - _EPS)), len(targets), failed)


def router_status(queue: RouterQueue) -> dict[str, Any]:
    """The keys of status.autoscaling that report the router pods (null, which removes them, without a router)."""
    if not queue.num_routers:
        return {"routerQueuedRequests": None, "numRouterPods": None, "numUnreachableRouterPods": None,
                "failedRouterPods": None}  # fmt: skip
    failed = [{"pod": f.pod, "kind": f.kind, "detail": f.detail[:200]} for f in queue.failed[:MAX_REPORTED_FAILURES]]
    return {
        "routerQueuedRequests": queue.num_queued,
        "numRouterPods": queue.num_routers,
        "numUnreachableRouterPods": len(queue.failed),
        "failedRouterPods": failed or None,
    }
