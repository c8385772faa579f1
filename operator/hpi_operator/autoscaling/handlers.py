"""The builtin autoscaler's kopf handlers, added to a registry by `register_autoscaler` (no import-time state).

- an index of the runtime pods (kopf keeps it current from a watch: no API reads per poll), by
  InferenceDeployment, holding a scrape target for each ready pod; and one of the router pods (routing mode
  router), whose queue is demand the runtime pods cannot show (router_queue.py);
- a timer per InferenceDeployment whose spec asks for the builtin scaler or the fleet optimizer (kopf starts
  and stops it as the spec changes): it ticks often, polls every pollIntervalSeconds as recorded on the
  resource, scrapes, and
  - builtin: decides (decision.py), writes spec.replicas through the scale subresource when the decision moves
    (field manager `hpi-autoscaler`; the reconciler then spreads them over the pools) and status (current KV
    utilisation, the last decision with its reason, unreachable pods, and the scaler's memory);
  - optimizer: decides replicas per pool (fleet_loop.py) and writes them, explained, to
    status.autoscaling.optimizer, which the reconciler's plan runs (spec.replicas is not used), pricing pools
    without spec.placement.pools[].costPerHour from their nodes' price label (`node_price_label`);
  and posts an Event on every scale (and when the SLO becomes unattainable).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from typing import Any

import kopf

from ..fleet.pricing import NodePrices, node_prices
from ..kube import KubeClient, object_path, with_query
from ..manifests import short_name
from ..names import (
    AUTOSCALER_FIELD_MANAGER,
    GROUP,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    NODE_PRICE_LABEL,
    OPERATOR_NAME,
    PLURAL,
    VERSION,
)
from ..nodes import NodeInfo
from ..plan import make_plan
from ..routing_manifests import LABEL_ROUTER, ROUTER_PORT
from ..spec import SpecError, parse_spec
from .fleet_loop import fleet_poll
from .fleet_status import optimizer_replicas
from .loop import PollResult, builtin_active, poll, poll_due
from .router_queue import RouterQueue, router_status, scrape_router_queue
from .scrape import (
    DEFAULT_TIMEOUT_S,
    PodTarget,
    Scraped,
    ready_pod_targets,
    running_pod_targets,
    scrape_pods,
    startup_by_pool,
)
from .sleep import DEFAULT_TIMEOUT_S as SLEEP_TIMEOUT_S
from .sleep import call_pods

DEFAULT_TICK_S = 1.0
MERGE_PATCH = "application/merge-patch+json"


def wants_builtin(spec: Mapping[str, Any], **_: Any) -> bool:
    """kopf `when=` filter: the timer runs only for resources whose spec asks for the builtin scaler or the
    fleet optimizer."""
    try:
        parsed = parse_spec(spec)
    except SpecError:
        return False  # the reconciler reports it; nothing to scale until it is fixed
    return builtin_active(parsed.autoscaling) or parsed.optimized


def replacing(old: Any, new: Any) -> Any:
    """`new` as a JSON merge patch over `old` that leaves none of old's keys behind (null removes them)."""
    if not isinstance(new, Mapping) or not isinstance(old, Mapping):
        return new
    gone = {key: None for key in old if key not in new}
    return {**gone, **{key: replacing(old.get(key), value) for key, value in new.items()}}


def write_replicas(kube: KubeClient, namespace: str, name: str, replicas: int) -> None:
    """Set the InferenceDeployment's spec.replicas through its scale subresource, as an HPA does, under the
    autoscaler's own field manager (so managedFields say who scaled; the reconciler never writes this field)."""
    path = object_path("InferenceDeployment", namespace, name) + "/scale"
    kube.request("PATCH", with_query(path, fieldManager=AUTOSCALER_FIELD_MANAGER), {"spec": {"replicas": replicas}},
                 MERGE_PATCH)  # fmt: skip


def register_autoscaler(
    registry: kopf.OperatorRegistry,
    tick_s: float = DEFAULT_TICK_S,
    scrape_timeout_s: float = DEFAULT_TIMEOUT_S,
    node_price_label: str = NODE_PRICE_LABEL,
) -> None:
    @kopf.index("", "v1", "pods", id="runtime_pods", labels={LABEL_MANAGED_BY: OPERATOR_NAME}, registry=registry)
    def runtime_pods(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict[Any, list[PodTarget]]:
        # Always a value (an empty list when not ready): kopf keeps a pod's old value if the function returns None.
        return {(namespace, labels.get(LABEL_DEPLOYMENT)): ready_pod_targets([body])}

    # Every running runtime pod, ready or not: scale-to-sleep must find the sleeping ones (not ready) to wake them.
    @kopf.index("", "v1", "pods", id="running_runtime_pods", labels={LABEL_MANAGED_BY: OPERATOR_NAME},
                registry=registry)  # fmt: skip
    def running_runtime_pods(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any
                             ) -> dict[Any, list[PodTarget]]:  # fmt: skip
        return {(namespace, labels.get(LABEL_DEPLOYMENT)): running_pod_targets([body])}

    # By the router label alone: router pods carry the managed-by label today, but the queue must be read from a
    # router whoever stamps it (the runtime index above files them under no InferenceDeployment).
    @kopf.index("", "v1", "pods", id="router_pods", labels={LABEL_ROUTER: kopf.PRESENT}, registry=registry)
    def router_pods(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict[Any, list[PodTarget]]:
        return {(namespace, labels.get(LABEL_ROUTER)): ready_pod_targets([body], default_port=ROUTER_PORT)}

    @kopf.timer(GROUP, VERSION, PLURAL, id="autoscaler", interval=tick_s, when=wants_builtin, registry=registry)
    async def autoscaler(
        body: kopf.Body,
        name: str,
        namespace: str,
        spec: kopf.Spec,
        meta: kopf.Meta,
        status: kopf.Status,
        patch: kopf.Patch,
        runtime_pods: kopf.Index,
        running_runtime_pods: kopf.Index,
        router_pods: kopf.Index,
        logger: kopf.Logger,
        memo: kopf.Memo,
        **kwargs: Any,
    ) -> None:
        if meta.get("deletionTimestamp"):
            return
        try:
            parsed = parse_spec(spec)
        except SpecError:
            return
        settings = parsed.autoscaling
        now_s = time.time()
        if not poll_due(status.get("autoscaling"), settings, now_s, slack_s=tick_s / 2):
            return
        targets = [t for targets in runtime_pods.get((namespace, short_name(name)), []) for t in targets]
        scraper = functools.partial(scrape_pods, timeout_s=scrape_timeout_s)
        routers = [t for targets in router_pods.get((namespace, short_name(name)), []) for t in targets]
        router = await scrape_router_queue(routers, scrape_timeout_s)
        report_router_failures(body, status, router)
        if parsed.optimized:
            nodes = [info for store in kwargs["node_inventory"].values() for info in store]
            prices = node_prices(node_price_label, nodes)
            await optimize_fleet(body, status, patch, targets, nodes, now_s, scraper, logger, prices, router)
            return
        running = [t for targets in running_runtime_pods.get((namespace, short_name(name)), []) for t in targets]
        caller = functools.partial(call_pods, timeout_s=SLEEP_TIMEOUT_S)
        result = await poll(settings, parsed.replicas, status, meta.get("annotations"), targets, now_s, scraper,
                            router, running, caller)  # fmt: skip
        report_sleep_calls(body, result)
        decision = result.decision
        if "metrics" in memo:
            scaled = decision.reason if result.scale_to is not None else None
            memo.metrics.record_decision(namespace, name, decision.desired_replicas, decision.kv_utilization, scaled)
        if result.scale_to is not None:
            await asyncio.to_thread(write_replicas, memo.kube, namespace, name, result.scale_to)
            kopf.event(body, type="Normal", reason=decision.reason, message=decision.message)
        before = (status.get("autoscaling") or {}).get("numUnreachablePods") or 0
        if decision.num_failed and decision.num_failed != before:  # an Event when it changes, not every poll
            failed = ", ".join(f"{f['pod']} ({f['kind']})" for f in result.status["autoscaling"]["failedPods"])
            message = f"{decision.num_failed} ready pod(s) without metrics, scale-down held: {failed}"
            kopf.event(body, type="Warning", reason="MetricsUnavailable", message=message)
        (logger.info if result.scale_to is not None else logger.debug)(f"autoscaler: {decision.message}")
        patch.status.update(result.status)


def report_sleep_calls(body: kopf.Body, result: PollResult) -> None:
    """An Event per poll that put pods to sleep or woke them, and a Warning naming the pods whose call failed."""
    done = [c.pod for c in result.sleep_calls if c.ok]
    failed = [f"{c.pod} ({c.detail[:200]})" for c in result.sleep_calls if not c.ok]
    if done:
        kopf.event(body, type="Normal", reason=result.decision.reason, message=f"{', '.join(done)}: "
                   f"{result.decision.message}"[:1000])  # fmt: skip
    if failed:
        kopf.event(body, type="Warning", reason="SleepCallFailed", message="; ".join(failed)[:1000])


def report_router_failures(body: kopf.Body, status: kopf.Status, router: RouterQueue) -> None:
    """A Warning Event when the number of router pods without a readable queue changes (not every poll)."""
    before = (status.get("autoscaling") or {}).get("numUnreachableRouterPods") or 0
    if router.failed and len(router.failed) != before:
        failed = ", ".join(f"{f.pod} ({f.kind})" for f in router.failed[:10])
        message = f"{len(router.failed)} router pod(s) without a readable queue, their requests unseen: {failed}"
        kopf.event(body, type="Warning", reason="RouterMetricsUnavailable", message=message[:1000])


async def optimize_fleet(
    body: kopf.Body,
    status: kopf.Status,
    patch: kopf.Patch,
    targets: list[PodTarget],
    nodes: list[NodeInfo],
    now_s: float,
    scraper: Any,
    logger: kopf.Logger,
    prices: NodePrices | None = None,
    router: RouterQueue = RouterQueue(),
) -> None:
    """One poll of the fleet optimizer: decide replicas per pool and write them, explained, to status."""
    try:
        plan = make_plan(body, nodes)
    except SpecError:
        return  # the reconciler reports it
    if not plan.placeable:
        return
    results = await scraper(targets) if targets else []
    loads = [r.load for r in results if isinstance(r, Scraped)]
    current = optimizer_replicas(status) or dict(plan.replicas_by_pool)
    starts: dict[str, list[float]] = {}
    for target in targets:
        if target.pool is not None and target.start_s is not None:
            starts.setdefault(target.pool, []).append(target.start_s)
    result = fleet_poll(plan, loads, status, current, now_s, prices, starts, router.num_queued)
    old = (status.get("autoscaling") or {}).get("optimizer") or {}
    patch.status["autoscaling"] = {"lastPollEpoch": round(now_s, 3), "optimizer": replacing(old, result.status),
                                   **router_status(router), "startup": startup_by_pool(results, targets)}  # fmt: skip
    if result.changed:
        kopf.event(body, type="Normal", reason="FleetScaled", message=result.message[:1000])
    if not result.feasible and old.get("feasible", True):
        kopf.event(body, type="Warning", reason="SLOUnattainable", message=str(result.status["reason"])[:1000])
    (logger.info if result.changed else logger.debug)(f"fleet optimizer: {result.message}")
