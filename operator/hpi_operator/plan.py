"""The whole decision for one InferenceDeployment, as a pure function of its body and the node inventory.

CR body + nodes -> spec -> pools -> a profile per pool -> replicas per pool -> child manifests (adopted,
hash-stamped). The reconciler applies a Plan; `hpi-operator render` prints one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from .autoscale_manifests import autoscaler_child
from .manifests import Owner, build_deployment, build_pdb, build_service, selector_labels, stamp_hash
from .names import ANNOTATION_SPEC_HASH
from .nodes import NodeInfo, group_pools
from .placement import Slot, eligible_choices, rank_choices, spread_replicas
from .profiles import PoolChoice, choose_profile
from .sizing import model_shape
from .spec import InferenceSpec, parse_spec


@dataclass(frozen=True)
class Plan:
    owner: Owner
    spec: InferenceSpec
    choices: tuple[PoolChoice, ...]  # every usable pool, with or without a profile
    replicas_by_pool: Mapping[str, int]  # pools that serve, most wanted first
    deployments: tuple[dict[str, Any], ...]  # in the order of replicas_by_pool
    service: dict[str, Any]
    pdb: dict[str, Any]
    num_unplaced: int  # replicas beyond the serving pools' capacity (they wait Pending)
    autoscaler: dict[str, Any] | None = None  # the HPA (mode hpa) or ScaledObject (mode keda), if any

    @property
    def placeable(self) -> bool:
        return bool(self.deployments)

    @property
    def children(self) -> tuple[dict[str, Any], ...]:
        return (*self.deployments, self.service, self.pdb, *([self.autoscaler] if self.autoscaler else []))

    @property
    def selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in selector_labels(self.owner.name).items())

    @property
    def fingerprint(self) -> str:
        """Changes whenever any child's desired manifest or any pool's verdict changes."""
        hashes = sorted(c["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for c in self.children)
        verdicts = sorted(f"{c.pool.name}:{c.reason}" for c in self.choices)
        return hashlib.sha256("\n".join(hashes + verdicts).encode()).hexdigest()[:16]

    def choice(self, pool_name: str) -> PoolChoice:
        return next(c for c in self.choices if c.pool.name == pool_name)


def make_plan(body: Mapping[str, Any], nodes: Iterable[NodeInfo]) -> Plan:
    """Decide everything for `body` (an InferenceDeployment as a dict); raises SpecError on a bad spec."""
    metadata = body.get("metadata") or {}
    owner = Owner(name=metadata["name"], namespace=metadata.get("namespace") or "default")
    spec = parse_spec(body.get("spec"))
    shape = model_shape(spec.model)
    pools = group_pools(nodes, spec.placement.node_selector, spec.placement.tolerations)
    choices = tuple(choose_profile(pool, spec, shape) for pool in pools)
    serving = rank_choices(eligible_choices(choices, spec.placement.allowed_pools), spec.placement.preferred_pools)
    slots = [Slot(c.pool.name, c.capacity) for c in serving]
    replicas_by_pool = spread_replicas(spec.replicas, slots)
    deployments = []
    for choice in serving:
        assert choice.profile is not None  # eligible_choices keeps pools with a profile only
        deployments.append(
            build_deployment(owner, spec, choice.pool, choice.profile, replicas_by_pool[choice.pool.name])
        )
    service, pdb = build_service(owner), build_pdb(owner)
    children = [*deployments, service, pdb]
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
        service=service,
        pdb=pdb,
        num_unplaced=max(0, spec.replicas - sum(s.capacity for s in slots)),
        autoscaler=autoscaler_child(body, owner, spec),
    )
