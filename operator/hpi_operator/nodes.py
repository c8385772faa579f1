"""Node inventory: what a node offers (parsed from GFD/NFD labels), and its grouping into node pools.

Pure functions over plain dicts. The kopf index stores one `NodeInfo` per node; `group_pools` turns the
usable ones into pools, per InferenceDeployment because node selectors and tolerations differ per spec.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils import parse_quantity

from .names import NODE_POOL_LABEL

GPU_PRODUCT = "nvidia.com/gpu.product"
GPU_MEMORY_MIB = "nvidia.com/gpu.memory"
GPU_COUNT = "nvidia.com/gpu.count"
GPU_COMPUTE_MAJOR = "nvidia.com/gpu.compute.major"
GPU_RESOURCE = "nvidia.com/gpu"
CPU_AVX512BF16 = "feature.node.kubernetes.io/cpu-cpuid.AVX512BF16"
CPU_AMXBF16 = "feature.node.kubernetes.io/cpu-cpuid.AMXBF16"
ARCH = "kubernetes.io/arch"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"  # the cloud's machine type (well-known label)
# GPUs before Ampere (compute capability < 8) have no bf16; GFD may lack the compute label on old setups.
_PRE_AMPERE = re.compile(r"(^|-)(T4|V100|P100|P40|P4|K80|M60|TITAN-V|QUADRO-RTX|RTX-20)", re.IGNORECASE)
# The toleration every GPU pool carries: the NVIDIA GPU operator and most clouds taint GPU nodes so.
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class NodeInfo:
    """What one node offers to inference pods (only the facts the operator uses)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ready: bool = True
    schedulable: bool = True
    taints: tuple[Mapping[str, Any], ...] = ()
    gpu_product: str | None = None
    gpu_memory_mib: int = 0
    num_gpus: int = 0  # allocatable nvidia.com/gpu, else the GFD count label
    gpu_bf16: bool = False
    arch: str = "amd64"
    cpu_bf16: bool = False
    cpu_amx: bool = False
    memory_bytes: int = 0  # allocatable
    cpu_millis: int = 0  # allocatable
    pool_label: str | None = None


def _int_label(labels: Mapping[str, str], key: str) -> int:
    try:
        return int(labels.get(key, "0"))
    except ValueError:
        return 0


def node_info(node: Mapping[str, Any]) -> NodeInfo:
    """Parse a v1 Node object (as a dict) into a NodeInfo."""
    metadata = node.get("metadata") or {}
    labels = dict(metadata.get("labels") or {})
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    allocatable = status.get("allocatable") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    product = labels.get(GPU_PRODUCT)
    num_gpus = int(parse_quantity(allocatable[GPU_RESOURCE])) if GPU_RESOURCE in allocatable else 0
    if GPU_RESOURCE not in allocatable:
        num_gpus = _int_label(labels, GPU_COUNT)
    if GPU_COMPUTE_MAJOR in labels:
        gpu_bf16 = _int_label(labels, GPU_COMPUTE_MAJOR) >= 8
    else:
        gpu_bf16 = product is not None and not _PRE_AMPERE.search(product)
    return NodeInfo(
        name=metadata.get("name", ""),
        labels=labels,
        ready=ready,
        schedulable=not spec.get("unschedulable", False),
        taints=tuple(spec.get("taints") or ()),
        gpu_product=product,
        gpu_memory_mib=_int_label(labels, GPU_MEMORY_MIB),
        num_gpus=num_gpus,
        gpu_bf16=gpu_bf16,
        arch=labels.get(ARCH, "amd64"),
        cpu_bf16=labels.get(CPU_AVX512BF16) == "true" or labels.get(CPU_AMXBF16) == "true",
        cpu_amx=labels.get(CPU_AMXBF16) == "true",
        memory_bytes=int(parse_quantity(allocatable.get("memory", 0))),
        cpu_millis=int(parse_quantity(allocatable.get("cpu", 0)) * 1000),
        pool_label=labels.get(NODE_POOL_LABEL),
    )


@dataclass(frozen=True)
class Pool:
    """Nodes of one kind: the unit that gets one profile and one Deployment."""

    name: str
    device: str  # "cuda" or "cpu"
    node_names: tuple[str, ...]
    gpu_product: str | None = None
    gpu_memory_mib: int = 0
    gpus_per_node: tuple[int, ...] = ()  # per node, same order as node_names
    gpu_bf16: bool = False
    arch: str = "amd64"
    cpu_bf16: bool = False  # AVX512-BF16 or AMX: bf16 runs natively, and is the default dtype
    cpu_amx: bool = False  # AMX: torch's own bf16 GEMMs (oneDNN) are fast too (shown in the pool's description)
    memory_bytes_per_node: tuple[int, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    match_expressions: tuple[Mapping[str, Any], ...] = ()
    tolerations: tuple[Mapping[str, Any], ...] = ()
    instance_type: str | None = None  # shared by every node of the pool, else None

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    @property
    def min_memory_bytes(self) -> int:
        return min(self.memory_bytes_per_node, default=0)

    @property
    def max_gpus_per_node(self) -> int:
        return max(self.gpus_per_node, default=0)

    def describe(self) -> str:
        if self.device == "cuda":
            return f"{self.num_nodes} node(s) x {self.max_gpus_per_node} {self.gpu_product} ({self.gpu_memory_mib} MiB)"
        bf16 = "AMX bf16" if self.cpu_amx else "AVX512-BF16, no AMX" if self.cpu_bf16 else "no bf16"
        return f"{self.num_nodes} {self.arch} CPU node(s), {bf16}, {self.min_memory_bytes // 2**30} GiB"


def toleration_matches(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Kubernetes' rule for whether one toleration tolerates one taint."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    operator = toleration.get("operator", "Equal")
    if not toleration.get("key"):
        return operator == "Exists"
    if toleration["key"] != taint.get("key"):
        return False
    return operator == "Exists" or toleration.get("value", "") == taint.get("value", "")


def node_usable(
    node: NodeInfo, node_selector: Mapping[str, str], tolerations: Iterable[Mapping[str, Any]]
) -> tuple[bool, str]:
    """Whether replicas could run on this node; if not, why (for logs and tests)."""
    if not node.ready:
        return False, "NotReady"
    if not node.schedulable:
        return False, "unschedulable"
    if any(node.labels.get(k) != v for k, v in node_selector.items()):
        return False, "does not match spec.placement.nodeSelector"
    tolerations = list(tolerations) + ([GPU_TOLERATION] if node.gpu_product else [])
    for taint in node.taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(
            toleration_matches(t, taint) for t in tolerations
        ):
            return False, f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} not tolerated"
    return True, ""


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return re.sub(r"^(nvidia-)?(tesla-)?", "", slug) or "unknown"


def _pool_key(node: NodeInfo) -> tuple[Any, ...]:
    if node.pool_label:
        return ("label", node.pool_label)
    if node.gpu_product:
        return ("cuda", node.gpu_product, node.gpu_memory_mib)
    return ("cpu", node.arch, node.cpu_bf16)


def _pool_name(key: tuple[Any, ...], product_collides: bool) -> str:
    if key[0] == "label":
        return key[1]
    if key[0] == "cuda":
        name = f"gpu-{_slug(key[1])}"
        return f"{name}-{key[2] // 1024}g" if product_collides else name
    return f"cpu-{_slug(key[1])}" + ("-bf16" if key[2] else "")


def _selection(key: tuple[Any, ...], node: NodeInfo) -> tuple[dict[str, str], tuple[dict[str, Any], ...]]:
    """The nodeSelector and node-affinity expressions that pick exactly this pool's kind of node."""
    not_labelled = {"key": NODE_POOL_LABEL, "operator": "DoesNotExist"}
    if key[0] == "label":
        return {NODE_POOL_LABEL: key[1]}, ()
    if key[0] == "cuda":
        return {GPU_PRODUCT: node.gpu_product or "", GPU_MEMORY_MIB: str(node.gpu_memory_mib)}, (not_labelled,)
    bf16 = (
        {"key": CPU_AVX512BF16, "operator": "In", "values": ["true"]}
        if node.cpu_bf16 and node.labels.get(CPU_AVX512BF16) == "true"
        else {"key": CPU_AMXBF16, "operator": "In", "values": ["true"]}
        if node.cpu_bf16
        else {"key": CPU_AVX512BF16, "operator": "DoesNotExist"}
    )
    no_gpu = {"key": GPU_PRODUCT, "operator": "DoesNotExist"}
    return {ARCH: node.arch}, (no_gpu, bf16, not_labelled)


def _shared(values: Iterable[str | None]) -> str | None:
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


def group_pools(
    nodes: Iterable[NodeInfo],
    node_selector: Mapping[str, str] | None = None,
    tolerations: Iterable[Mapping[str, Any]] = (),
) -> list[Pool]:
    """Group the usable nodes into pools, sorted by name (deterministic for equal inventories)."""
    tolerations = tuple(tolerations)
    node_selector = dict(node_selector or {})
    groups: dict[tuple[Any, ...], list[NodeInfo]] = {}
    for node in sorted(nodes, key=lambda n: n.name):
        if node_usable(node, node_selector, tolerations)[0]:
            groups.setdefault(_pool_key(node), []).append(node)
    products = [key[1] for key in groups if key[0] == "cuda"]
    pools = []
    for key, members in groups.items():
        first = members[0]
        selector, expressions = _selection(key, first)
        is_gpu = first.gpu_product is not None
        pools.append(
            Pool(
                name=_pool_name(key, products.count(key[1]) > 1),
                device="cuda" if is_gpu else "cpu",
                node_names=tuple(n.name for n in members),
                gpu_product=first.gpu_product,
                # Explicitly labelled pools may mix GPU kinds: plan for the smallest.
                gpu_memory_mib=min(n.gpu_memory_mib for n in members),
                gpus_per_node=tuple(n.num_gpus for n in members),
                gpu_bf16=all(n.gpu_bf16 for n in members),
                arch=first.arch,
                cpu_bf16=all(n.cpu_bf16 for n in members),
                cpu_amx=all(n.cpu_amx for n in members),
                memory_bytes_per_node=tuple(n.memory_bytes for n in members),
                node_selector={**selector, **node_selector},
                match_expressions=expressions,
                tolerations=tolerations + ((GPU_TOLERATION,) if is_gpu else ()),
                instance_type=_shared(n.labels.get(INSTANCE_TYPE) for n in members),
            )
        )
    return sorted(pools, key=lambda p: p.name)
