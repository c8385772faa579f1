"""kopf handlers: a registry built by a function (no import-time global state), so tests and the CLI can
run operators with different settings in one process.

- an index of nodes (the inventory; kopf keeps it current from a watch, nothing polls);
- an index of the Deployments this operator manages (their rollout state, for status);
- create/update/resume of an InferenceDeployment -> reconcile;
- a timer per InferenceDeployment that re-reconciles when the inventory changes what the plan would be,
  and otherwise refreshes status from the Deployment index (no API reads, and no write when nothing moved);
- the builtin KV-cache autoscaler (autoscale_handlers.py): an index of runtime pods and a timer per resource.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from .autoscale_handlers import register_autoscaler
from .cache import RETRY_BASE_DELAY_S
from .cache_sync import MODEL_CACHED
from .kube import KubeClient, load_api_client
from .manifests import short_name
from .names import GROUP, LABEL_DEPLOYMENT, LABEL_MANAGED_BY, OPERATOR_NAME, PLURAL, VERSION
from .nodes import NodeInfo, node_info
from .op_metrics import OperatorMetrics
from .plan import Plan, make_plan
from .reconcile import Outcome, reconcile
from .spec import SpecError
from .status import ChildState, build_status, conditions_equal


@dataclass(frozen=True)
class OperatorConfig:
    resync_interval_s: float = 10.0  # how often each InferenceDeployment compares its plan with the inventory
    metrics_port: int | None = None  # the operator's own /metrics; None: not served
    autoscale_tick_s: float = 1.0  # how often a builtin-autoscaled resource checks whether a poll is due
    cache_retry_base_s: float = RETRY_BASE_DELAY_S  # backoff after the first failed model-cache download


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def inventory_nodes(index: Mapping[Any, Iterable[NodeInfo]]) -> list[NodeInfo]:
    return [info for store in index.values() for info in store]


def _finish(outcome: Outcome, body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo) -> None:
    patch.status.update(outcome.status)
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    memo.metrics.count_reconcile(outcome.result)
    if outcome.error is not None:
        raise outcome.error


def cache_unsettled(plan: Plan, status: Mapping[str, Any]) -> bool:
    """The model cache still has work: a download running or failed, pods to move, an old revision to remove.
    Each resync then runs the whole reconcile, which reads the cache Jobs (nothing watches them)."""
    if plan.cache is None:
        return False
    entry = status.get("modelCache") or {}
    cached = any(c.get("type") == MODEL_CACHED and c.get("status") == "True" for c in status.get("conditions") or [])
    return not cached or entry.get("servedPath") != plan.cache.path or bool(entry.get("previousPath"))


def diff_base_storage() -> kopf.AnnotationsDiffBaseStorage:
    """Where kopf keeps the last configuration its change handlers finished (an annotation under our group)."""
    return kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")


def change_pending(body: kopf.Body) -> bool:
    """A change the create/update handlers have not finished yet, including one to labels or annotations (they
    reach the children but leave metadata.generation alone). A resync must leave it to them: run at the same
    time on the older body, it would prune what they just created (an HPA, the router's objects)."""
    storage = diff_base_storage()
    return storage.fetch(body=body) != storage.build(body=body)


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A fresh registry has no login handlers: use the kubernetes client's (in-cluster or kubeconfig).
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # Progress and diff-base in annotations under our group: status keeps only what the CRD declares
        # (a real API server prunes unknown status fields of a structural schema).
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = diff_base_storage()
        settings.persistence.finalizer = f"{GROUP}/finalizer"
        settings.posting.level = logging.WARNING  # handler chatter stays in logs; Events are ours
        settings.watching.server_timeout = 300
        if "kube" not in memo:
            memo.kube = KubeClient(load_api_client())
        if "metrics" not in memo:
            memo.metrics = OperatorMetrics()
            if config.metrics_port:
                memo.metrics.serve(config.metrics_port)

    @kopf.index("", "v1", "nodes", id="node_inventory", registry=registry)
    def node_inventory(body: kopf.Body, name: str, **_: Any) -> dict[str, NodeInfo]:
        return {name: node_info(body)}

    @kopf.index(
        "apps", "v1", "deployments", id="runtime_deployments",
        labels={LABEL_MANAGED_BY: OPERATOR_NAME}, registry=registry,
    )  # fmt: skip
    def runtime_deployments(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict[Any, ChildState]:
        return {(namespace, labels.get(LABEL_DEPLOYMENT)): ChildState.from_deployment(body)}

    @kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    def reconcile_handler(
        body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, node_inventory: kopf.Index, **_: Any
    ) -> None:
        nodes = inventory_nodes(node_inventory)
        memo.metrics.set_nodes("gpu", sum(1 for n in nodes if n.gpu_product))
        memo.metrics.set_nodes("cpu", sum(1 for n in nodes if not n.gpu_product))
        _finish(reconcile(body, nodes, memo.kube, utc_now(), config.cache_retry_base_s), body, patch, memo)

    @kopf.timer(GROUP, VERSION, PLURAL, id="resync", interval=config.resync_interval_s, registry=registry)
    def resync(
        body: kopf.Body,
        meta: kopf.Meta,
        status: kopf.Status,
        patch: kopf.Patch,
        memo: kopf.Memo,
        node_inventory: kopf.Index,
        runtime_deployments: kopf.Index,
        logger: kopf.Logger,
        **_: Any,
    ) -> None:
        generation = meta.get("generation")
        if meta.get("deletionTimestamp"):
            return  # going away: garbage collection takes the children, nothing to converge
        if status.get("observedGeneration") != generation or change_pending(body):
            return  # the change handlers have not finished this change: theirs to do
        nodes = inventory_nodes(node_inventory)
        try:
            plan = make_plan(body, nodes)
        except SpecError:
            return  # already reported; only a new spec can fix it
        owner_key = (plan.owner.namespace, short_name(plan.owner.name))
        states = {s.name: s for s in runtime_deployments.get(owner_key, [])}
        wanted = {d["metadata"]["name"] for d in plan.deployments}
        if plan.fingerprint != status.get("appliedHash") or not wanted <= set(states) or cache_unsettled(plan, status):
            try:
                _finish(reconcile(body, nodes, memo.kube, utc_now(), config.cache_retry_base_s), body, patch, memo)
            except (kopf.PermanentError, kopf.TemporaryError) as e:
                logger.info(f"resync could not converge yet: {e}")  # status and Events already say why
            return
        if not plan.placeable:
            return
        cache = None
        if plan.cache is not None:  # settled: carried over as the last reconcile wrote it
            cached = next(c for c in status.get("conditions") or [] if c.get("type") == MODEL_CACHED)
            cache = (status.get("modelCache") or {}, {k: v for k, v in cached.items() if k != "lastTransitionTime"})
        fresh = build_status(plan, states, int(generation or 0), status, utc_now(), cache)
        changed = {k: v for k, v in fresh.items() if k != "conditions" and status.get(k) != v}
        if changed or not conditions_equal(status.get("conditions") or [], fresh["conditions"]):
            patch.status.update(fresh)

    register_autoscaler(registry, tick_s=config.autoscale_tick_s)  # autoscale_handlers.py
    return registry
