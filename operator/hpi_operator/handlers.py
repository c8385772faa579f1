"""kopf handlers: a registry built by a function (no import-time global state), so tests and the CLI can
run operators with different settings in one process.

Level-based reconciliation: one loop per InferenceDeployment (a kopf timer whose every tick waits for a
wake-up, then runs `reconcile.reconcile` once on the current state and writes the status that changed).
It wakes on:
- any event of the resource (a spec, label or annotation change; its deletion stops the loop);
- any event of a child that points back at it (owner reference): a deleted child is recreated and a
  hand-edited one reverted within one pass;
- the resync period running out (node inventory changes, anything a watch missed).
A pass that finds everything in place writes nothing. Besides the loop:
- an index of nodes (the inventory; kopf keeps it current from a watch, nothing polls);
- the builtin KV-cache autoscaler (autoscaling/handlers.py): an index of runtime pods and a timer per resource;
- status.routing.tenantKeys, read from the router pods (tenant_keys.py): a timer per resource with tenants;
- spec.adapters, downloaded and loaded on the running pods (adapter_sync.py): a timer per resource with adapters.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from .adapter_sync import register_adapters
from .autoscaling.handlers import register_autoscaler
from .cache import RETRY_BASE_DELAY_S
from .kube import KubeClient, load_api_client
from .names import GROUP, LABEL_MANAGED_BY, NODE_PRICE_LABEL, OPERATOR_NAME, PLURAL, VERSION
from .network_policies import OperatorIdentity
from .nodes import NodeInfo, node_info
from .op_metrics import OperatorMetrics
from .profiling import RETRY_BASE_DELAY_S as PROFILE_RETRY_BASE_DELAY_S
from .reconcile import Outcome, reconcile
from .status import status_changes
from .tenant_keys import register_tenant_keys
from .wakeups import Wakeups, owner_uids

# The children whose events wake their InferenceDeployment's loop: (group, version, plural).
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("inference.networking.k8s.io", "v1", "inferencepools"),
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("keda.sh", "v1alpha1", "scaledobjects"),
    ("", "v1", "persistentvolumeclaims"),
    ("batch", "v1", "jobs"),
)
LOOP_TICK_S = 0.01  # kopf's pause between two passes of a loop; the wait for a wake-up is the real one


@dataclass(frozen=True)
class OperatorConfig:
    resync_interval_s: float = 10.0  # the longest a loop waits without a wake-up (inventory changes, missed events)
    metrics_port: int | None = None  # the operator's own /metrics; None: not served
    autoscale_tick_s: float = 1.0  # how often a builtin-autoscaled resource checks whether a poll is due
    cache_retry_base_s: float = RETRY_BASE_DELAY_S  # backoff after the first failed model-cache download
    profile_retry_base_s: float = PROFILE_RETRY_BASE_DELAY_S  # backoff after the first failed profiling Job
    debounce_s: float = 0.05  # after a wake-up: let the burst of events (its own writes) settle into one pass
    node_price_label: str = NODE_PRICE_LABEL  # the fleet optimizer's node price label ("" reads none)
    tenant_keys_interval_s: float = 15.0  # how often status.routing.tenantKeys is read from the router pods
    adapters_interval_s: float = 10.0  # how often spec.adapters is brought to the pods (adapter_sync.py)
    # The operator's own pod, which spec.networkPolicy admits to the pods it calls; None: unknown (run outside a
    # cluster), and the policies admit no operator (a warning says so once, at start-up).
    identity: OperatorIdentity | None = None


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def inventory_nodes(index: Mapping[Any, Iterable[NodeInfo]]) -> list[NodeInfo]:
    return [info for store in index.values() for info in store]


def _finish(outcome: Outcome, body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: kopf.Logger) -> None:
    changes = status_changes(body.get("status") or {}, outcome.status)
    if changes:
        patch.status.update(changes)
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    memo.metrics.count_reconcile(outcome.result)
    if outcome.error is not None:  # status and Events say why; the next wake-up or resync tries again
        logger.info(f"reconcile did not converge: {outcome.error}")


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A fresh registry has no login handlers: use the kubernetes client's (in-cluster or kubeconfig).
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
        # kopf's own bookkeeping in annotations under our group: status keeps only what the CRD declares.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        settings.persistence.finalizer = f"{GROUP}/finalizer"
        settings.posting.level = logging.WARNING  # handler chatter stays in logs; Events are ours
        settings.watching.server_timeout = 300
        # A deleted resource keeps kopf's finalizer until its loop has stopped; a loop caught mid-pass stops a
        # moment later, and kopf looks again after this long (its default, 60 s, would hold the deletion).
        settings.background.cancellation_polling = 1.0
        if "kube" not in memo:
            memo.kube = KubeClient(load_api_client())
        if "metrics" not in memo:
            memo.metrics = OperatorMetrics()
            if config.metrics_port:
                memo.metrics.serve(config.metrics_port)
        memo.wakeups = Wakeups()
        if config.identity is None:
            logger.warning("the operator does not know its own pod (POD_NAMESPACE and --self-labels unset): the "
                           "NetworkPolicies of spec.networkPolicy will not admit its metrics scrapes")  # fmt: skip

    @kopf.index("", "v1", "nodes", id="node_inventory", registry=registry)
    def node_inventory(body: kopf.Body, name: str, **_: Any) -> dict[str, NodeInfo]:
        return {name: node_info(body)}

    @kopf.on.event(GROUP, VERSION, PLURAL, id="wake_on_change", registry=registry)
    async def wake_on_change(uid: str, type: str, memo: kopf.Memo, **_: Any) -> None:
        if type == "DELETED":
            memo.wakeups.forget(uid)
        else:
            memo.wakeups.wake([uid])

    async def wake_owner(meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
        memo.wakeups.wake(owner_uids(meta))

    for group, version, plural in CHILD_RESOURCES:
        kopf.on.event(group, version, plural, id=f"wake_on_{plural}", labels={LABEL_MANAGED_BY: OPERATOR_NAME},
                      registry=registry)(wake_owner)  # fmt: skip

    # backoff: a pass that failed unexpectedly is retried after a second (kopf's default is a minute).
    @kopf.timer(GROUP, VERSION, PLURAL, id="reconcile", interval=LOOP_TICK_S, backoff=1.0, registry=registry)
    async def reconcile_loop(
        body: kopf.Body,
        uid: str,
        meta: kopf.Meta,
        patch: kopf.Patch,
        memo: kopf.Memo,
        node_inventory: kopf.Index,
        stopped: Any,
        logger: kopf.Logger,
        **_: Any,
    ) -> None:
        stop = await memo.wakeups.wait(uid, config.resync_interval_s, stopped, config.debounce_s)
        if stop or meta.get("deletionTimestamp"):
            return  # going away: garbage collection takes the children, nothing to converge
        nodes = inventory_nodes(node_inventory)
        memo.metrics.set_nodes("gpu", sum(1 for n in nodes if n.gpu_product))
        memo.metrics.set_nodes("cpu", sum(1 for n in nodes if not n.gpu_product))
        snapshot = copy.deepcopy(dict(body))  # the body is a live view: one pass decides on one state
        outcome = await asyncio.to_thread(reconcile, snapshot, nodes, memo.kube, utc_now(), config.cache_retry_base_s,
                                          config.profile_retry_base_s, config.identity)  # fmt: skip
        _finish(outcome, body, patch, memo, logger)

    register_autoscaler(registry, tick_s=config.autoscale_tick_s,
                        node_price_label=config.node_price_label)  # autoscaling/handlers.py
    register_tenant_keys(registry, interval_s=config.tenant_keys_interval_s)  # its router_pods index
    register_adapters(registry, interval_s=config.adapters_interval_s,
                      retry_base_s=config.cache_retry_base_s)  # its runtime_pods index  # fmt: skip
    return registry
