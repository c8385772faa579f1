"""The whole decision for one InferenceDeployment, as a pure function of its body and the node inventory.

CR body + nodes -> spec -> pools -> a profile per pool -> replicas per pool -> child manifests: the runtime
Deployments, their PodDisruptionBudget and the routing objects of the effective spec.routing.mode (adopted,
hash-stamped). The reconciler applies a Plan; `hpi-operator render` prints one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from hpi_contracts.pool_profile import PoolProfile

from .autoscaling.fleet_status import optimizer_replicas, optimizer_slo_batches
from .autoscaling.manifests import autoscaler_child
from .cache import CachePlan, plan_cache
from .manifests import Owner, build_deployment, build_pdb, label_selector, short_name, stamp_hash
from .manifests_lws import build_leaderworkerset
from .names import ANNOTATION_SPEC_HASH
from .network_policies import OperatorIdentity, network_policies
from .nodes import NodeInfo, group_pools
from .placement import Slot, eligible_choices, rank_choices, spread_replicas
from .profiles import PoolChoice, choose_profile
from .profiling import (
    ProfileTarget,
    build_pool_configmap,
    build_profile_job,
    cache_key,
    measured_from_status,
    node_kind,
    pool_configmap_name,
    pool_figures,
)
from .routing_manifests import routing_children
from .sizing import ModelShape, model_shape
from .spec import InferenceSpec, SpecError, effective_routing_mode, parse_spec


@dataclass(frozen=True)
class Plan:
    owner: Owner
    spec: InferenceSpec
    choices: tuple[PoolChoice, ...]  # every usable pool, with or without a profile
    replicas_by_pool: Mapping[str, int]  # pools that serve, most wanted first
    # The pools' runtime workloads, in the order of replicas_by_pool: a Deployment, or a LeaderWorkerSet for a pool
    # whose replicas span nodes (manifests_lws.py).
    deployments: tuple[dict[str, Any], ...]
    routing: tuple[dict[str, Any], ...]  # the routing objects of `routing_mode`, the user-facing Service among them
    routing_mode: str  # router | inferencePool | service: spec.routing.mode, or the default for this plan
    pdb: dict[str, Any]
    num_unplaced: int  # replicas beyond the serving pools' capacity (they wait Pending)
    autoscaler: dict[str, Any] | None = None  # the HPA (mode hpa) or ScaledObject (mode keda), if any
    cache: CachePlan | None = None  # spec.model.cache with a claim: the claim and the Job that fills it
    cached_dir: str | None = None  # the complete revision on the cache that pods run from (None: none yet)
    shape: ModelShape | None = None  # what the sizing arithmetic used
    # spec.placement.profiling in effect (profiling.py): per serving pool the figures it runs on (None: none yet),
    # the measured ones among them, the pools to measure, and the ConfigMaps that hand the figures to the pods.
    figures: Mapping[str, PoolProfile | None] = field(default_factory=dict)
    measured: Mapping[str, PoolProfile] = field(default_factory=dict)
    profile_targets: tuple[ProfileTarget, ...] = ()
    profile_configmaps: tuple[dict[str, Any], ...] = ()
    network_policies: tuple[dict[str, Any], ...] = ()  # spec.networkPolicy: those of `routing_mode`, if enabled

    @property
    def placeable(self) -> bool:
        return bool(self.replicas_by_pool)

    @property
    def desired_replicas(self) -> int:
        """Replicas over all pools: spec.replicas, or with the fleet optimizer the sum of its per-pool choice."""
        return sum(self.replicas_by_pool.values()) if self.spec.optimized else self.spec.replicas

    @property
    def waiting_for_cache(self) -> bool:
        """No revision of the model is complete on the cache yet: no runtime pod may start."""
        return self.cache is not None and not self.cached_dir

    @property
    def children(self) -> tuple[dict[str, Any], ...]:
        """What children.apply_plan writes (the cache's and the profiling Jobs are created and retried by
        cache_sync.py and profile_sync.py instead)."""
        claim = [self.cache.pvc] if self.cache and self.cache.pvc else []
        autoscaler = [self.autoscaler] if self.autoscaler else []
        return (*claim, *self.profile_configmaps, *self.deployments, *self.routing, self.pdb, *autoscaler,
                *self.network_policies)  # fmt: skip

    @property
    def service(self) -> dict[str, Any]:
        """The Service clients call (`<name>`), whatever sits behind it."""
        name = short_name(self.owner.name)
        return next(c for c in self.routing if c["kind"] == "Service" and c["metadata"]["name"] == name)

    @property
    def selector(self) -> str:
        return label_selector(self.owner.name)

    @property
    def fingerprint(self) -> str:
        """Changes whenever any child's desired manifest or any pool's verdict changes."""
        hashes = sorted(c["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for c in self.children)
        verdicts = sorted(f"{c.pool.name}:{c.reason}" for c in self.choices)
        cache = [self.cache.fill_job["metadata"]["name"], self.cached_dir or ""] if self.cache else []
        return hashlib.sha256("\n".join(hashes + verdicts + cache).encode()).hexdigest()[:16]

    def choice(self, pool_name: str) -> PoolChoice:
        return next(c for c in self.choices if c.pool.name == pool_name)


def make_plan(body: Mapping[str, Any], nodes: Iterable[NodeInfo], assume_cached: bool = False,
              measured: Mapping[str, PoolProfile] | None = None,
              operator: OperatorIdentity | None = None) -> Plan:  # fmt: skip
    """Decide everything for `body` (an InferenceDeployment as a dict); raises SpecError on a bad spec.

    `assume_cached`: plan the Deployments as if the model cache held the wanted revision (offline renders).
    `measured`: the pools' measured figures as profile_sync.py just found them; None: as status.pools records.
    `operator`: the operator's own pod, which spec.networkPolicy's policies admit; None: unknown (not in a
    cluster), and they admit no operator."""
    metadata = body.get("metadata") or {}
    owner = Owner(name=metadata["name"], namespace=metadata.get("namespace") or "default")
    spec = parse_spec(body.get("spec"))
    shape = model_shape(spec.model)
    pools = group_pools(nodes, spec.placement.node_selector, spec.placement.tolerations)
    choices = tuple(choose_profile(pool, spec, shape) for pool in pools)
    serving = rank_choices(eligible_choices(choices, spec.placement.allowed_pools), spec.placement.preferred_pools)
    slots = [Slot(c.pool.name, c.capacity) for c in serving]
    replicas_by_pool = spread_replicas(spec.replicas, slots)
    optimized = optimizer_replicas(body.get("status")) if spec.optimized else None
    if optimized is not None:  # the fleet optimizer's last decision (until its first: spec.replicas, rank-filled)
        replicas_by_pool = {slot.pool_name: optimized.get(slot.pool_name, 0) for slot in slots}
    cache = plan_cache(owner, spec, shape)
    # The revision complete on the cache (cache_sync.py records it in status when the fill Job completes).
    cached_dir = ((body.get("status") or {}).get("modelCache") or {}).get("servedPath") if cache else None
    if cache and assume_cached:
        cached_dir = cache.path
    deployments, started = [], []
    for choice in serving:
        assert choice.profile is not None  # eligible_choices keeps pools with a profile only
        if cache is None or cached_dir:  # never a pod on a partial cache
            replicas = replicas_by_pool[choice.pool.name]
            configmap = pool_configmap_name(owner.name, choice.pool.name) if spec.profiled else None
            build = build_leaderworkerset if choice.profile.multi_node else build_deployment
            deployments.append(build(owner, spec, choice.pool, choice.profile, replicas, cached_dir, configmap))
            started.append(choice)
    figures: dict[str, PoolProfile | None] = {}
    targets, profile_configmaps = [], []
    # The optimizer's planned SLO batches go to the router with the profiles (its shares: router policy.py).
    slo_batches = optimizer_slo_batches(body.get("status")) if spec.optimized else {}
    if spec.profiled:  # measured on the pools pods run on (not before the model cache is filled)
        keys = {c.pool.name: cache_key(spec, c.profile, c.pool) for c in started if c.profile is not None}
        measured = measured_from_status(body.get("status"), keys) if measured is None else {
            pool: figures for pool, figures in measured.items() if pool in keys}  # fmt: skip
        for choice in started:
            pool_name = choice.pool.name
            figures[pool_name] = pool_figures(spec, choice, shape, measured.get(pool_name))
            profile_configmaps.append(build_pool_configmap(owner, pool_name, figures[pool_name],
                                                           slo_batches.get(pool_name)))  # fmt: skip
            # A group is not measured: `hpi profile` runs one pod (its figures stay assumed or overridden).
            measurable = choice.profile is not None and not choice.profile.multi_node
            if spec.placement.pool(pool_name).performance is None and measurable:
                job = build_profile_job(owner, spec, choice.pool, choice.profile, cached_dir)
                targets.append(ProfileTarget(pool_name, keys[pool_name], node_kind(choice.pool), job))
    measured = measured if spec.profiled and measured else {}
    routing_mode = effective_routing_mode(spec, len(replicas_by_pool))
    routing = routing_children(owner, spec, routing_mode)
    runtime_names = {d["metadata"]["name"] for d in deployments}
    clash = [c["metadata"]["name"] for c in routing if (c["kind"], c["metadata"]["name"]) in
             {("Deployment", n) for n in runtime_names}]  # fmt: skip
    if clash:
        raise SpecError(
            f"node pool Deployment {clash[0]} collides with the {routing_mode}'s; rename the pool "
            "(node label serving.hpi.dev/pool) or set spec.routing.mode: service"
        )
    pdb = build_pdb(owner)
    multi_node = any(c.profile is not None and c.profile.multi_node for c in started)
    policies = network_policies(owner, spec, routing_mode, operator, multi_node)
    children = [*deployments, *routing, pdb, *policies, *([cache.pvc] if cache and cache.pvc else []),
                *profile_configmaps, *(t.job for t in targets)]  # fmt: skip
    if cache is not None:
        children.append(cache.fill_job)
    if metadata.get("uid"):  # offline renders of a CR that was never created have no owner to point at
        kopf.adopt(children, owner=dict(body))
    for child in children:
        stamp_hash(child)
    return Plan(
        owner=owner,
        spec=spec,
        choices=choices,
        replicas_by_pool=replicas_by_pool,
        deployments=tuple(deployments),
        routing=tuple(routing),
        routing_mode=routing_mode,
        pdb=pdb,
        num_unplaced=max(0, sum(replicas_by_pool.values()) - sum(s.capacity for s in slots)),
        autoscaler=autoscaler_child(body, owner, spec, routing_mode),
        cache=cache,
        shape=shape,
        cached_dir=cached_dir,
        figures=figures,
        measured=measured,
        profile_targets=tuple(targets),
        profile_configmaps=tuple(profile_configmaps),
        network_policies=tuple(policies),
    )
