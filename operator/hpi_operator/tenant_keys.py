"""status.routing.tenantKeys: how many API keys the router pods have loaded from spec.routing.router.tenantsSecretRef.

Read from the routers' /metrics (`hpi:router_tenant_keys`), never from the Secret: the operator needs no access to
Secrets and never holds a key, and the count is what the routers actually serve with (a changed Secret that a
router refused, bad YAML say, still shows its last good count). The lowest count over the ready router pods is
reported: the keys every one of them accepts (they differ only while the kubelet updates their volumes). A timer
per InferenceDeployment with a tenants Secret (or a count left in its status, which it then removes), using the
autoscaler's index of router pods (autoscaling/handlers.py).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import kopf
from prometheus_client.parser import text_string_to_metric_families

from hpi_contracts.metrics import ROUTER_TENANT_KEYS

from .autoscaling.scrape import DEFAULT_TIMEOUT_S, MetricsParseError, PodTarget, ScrapeFailed, fetch_metrics
from .manifests import short_name
from .names import GROUP, PLURAL, VERSION

DEFAULT_INTERVAL_S = 15.0


def parse_tenant_keys(text: str) -> int:
    """A router's /metrics text -> the API keys it loaded; MetricsParseError without a usable gauge."""
    try:
        values = [s.value for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name == ROUTER_TENANT_KEYS]  # fmt: skip
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise MetricsParseError(f"not Prometheus text: {e}") from e
    if len(values) != 1 or not math.isfinite(values[0]) or values[0] < 0:
        raise MetricsParseError(f"no single finite {ROUTER_TENANT_KEYS} sample: {values}")
    return int(values[0])


async def scrape_tenant_keys(targets: Sequence[PodTarget], timeout_s: float = DEFAULT_TIMEOUT_S) -> int | None:
    """The lowest count over the router pods that answered; None when none did."""
    async with aiohttp.ClientSession() as session:
        texts = await asyncio.gather(*(fetch_metrics(session, t, timeout_s) for t in targets))
    counts = []
    for text in texts:
        if isinstance(text, ScrapeFailed):
            continue
        try:
            counts.append(parse_tenant_keys(text))
        except MetricsParseError:
            continue  # an older router without the gauge: it says nothing about the keys
    return min(counts) if counts else None


def routing_status(num_keys: int | None) -> dict[str, Any]:
    return {"tenantKeys": num_keys}


def wants_tenant_keys(spec: Mapping[str, Any], status: Mapping[str, Any], **_: Any) -> bool:
    """kopf `when=` filter: a tenants Secret in the spec, or a count in the status to remove."""
    router = ((spec.get("routing") or {}).get("router") or {}) if isinstance(spec, Mapping) else {}
    return bool(router.get("tenantsSecretRef")) or bool((status or {}).get("routing"))


def register_tenant_keys(registry: kopf.OperatorRegistry, interval_s: float = DEFAULT_INTERVAL_S,
                         scrape_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:  # fmt: skip
    @kopf.timer(GROUP, VERSION, PLURAL, id="tenant_keys", interval=interval_s, when=wants_tenant_keys,
                registry=registry)  # fmt: skip
    async def tenant_keys(name: str, namespace: str, spec: kopf.Spec, status: kopf.Status, patch: kopf.Patch,
                          router_pods: kopf.Index, **_: Any) -> None:  # fmt: skip
        if not ((spec.get("routing") or {}).get("router") or {}).get("tenantsSecretRef"):
            patch.status["routing"] = None  # the Secret left the spec: so does its count
            return
        routers = [t for targets in router_pods.get((namespace, short_name(name)), []) for t in targets]
        num_keys = await scrape_tenant_keys(routers, scrape_timeout_s) if routers else None
        if (status.get("routing") or {}).get("tenantKeys") != num_keys:
            patch.status["routing"] = routing_status(num_keys)
