"""Node inventory: what a node offers (parsed from GFD/NFD labels, or the AMD GPU node labeller's), and its
grouping into node pools.

Pure functions over plain dicts. The kopf index stores one `NodeInfo` per node; `group_pools` turns the
usable ones into pools, per InferenceDeployment because node selectors and tolerations differ per spec.

GPUs of two vendors: NVIDIA (allocatable `nvidia.com/gpu`, GPU Feature Discovery's labels) and AMD (allocatable
`amd.com/gpu`, the ROCm k8s-device-plugin's node labeller: `amd.com/gpu.product-name`, `amd.com/gpu.vram` in
GiB with a G, `amd.com/gpu.family`, `amd.com/gpu.cu-count`; older labellers write the same under `beta.amd.com/`,
and the oldest only as `beta.amd.com/gpu.vram.<value>: <count>`). Both become pools of device "cuda": torch's
ROCm build drives AMD GPUs under CUDA's device name, so profiles, sizing and ranking are the same arithmetic; the
vendor decides the resource a pod requests, the taint it tolerates and the runtime image (manifests.py).
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
# AMD: the device plugin's resource and the node labeller's label names (under amd.com/ and, older, beta.amd.com/).
AMD_GPU_RESOURCE = "amd.com/gpu"
AMD_PRODUCT = "amd.com/gpu.product-name"
AMD_VRAM = "amd.com/gpu.vram"  # e.g. "192G": GiB, rounded
AMD_FAMILY = "amd.com/gpu.family"  # two letters or GC_x_y_z, e.g. "AI"
AMD_CU_COUNT = "amd.com/gpu.cu-count"
AMD_BETA = "beta."
AMD_GPU_TOLERATION = {"key": AMD_GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
GPU_RESOURCES = {"nvidia": GPU_RESOURCE, "amd": AMD_GPU_RESOURCE}
GPU_TOLERATIONS = {"nvidia": GPU_TOLERATION, "amd": AMD_GPU_TOLERATION}
# AMD GPUs with bf16 matrix instructions that torch's ROCm build uses: CDNA 1-4 (Instinct MI100 and later) and
# RDNA 3-4 (Radeon RX/PRO 7000 and 9000). Earlier parts (MI50/MI60, Vega, RDNA 1-2) run fp16.
_AMD_BF16 = re.compile(r"(MI[1-9]\d\d)|((RX|PRO_?W?)_?[79]\d\d\d)", re.IGNORECASE)
_VRAM_GIB = re.compile(r"^(\d+)G$")


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
    num_gpus: int = 0  # allocatable nvidia.com/gpu or amd.com/gpu, else the GFD count label
    gpu_bf16: bool = False
    gpu_vendor: str = "nvidia"  # nvidia | amd (meaningful only with gpu_product)
    gpu_cu_count: int = 0  # AMD compute units (the labeller's cu-count), for the pool's description
    # The labels that pick this node's kind of GPU (product and memory), as the labeller wrote them: a nodeSelector,
    # and expressions for the oldest AMD labeller's value-in-the-key form.
    gpu_selector: Mapping[str, str] = field(default_factory=dict)
    gpu_expressions: tuple[Mapping[str, Any], ...] = ()
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


def amd_label(labels: Mapping[str, str], name: str) -> tuple[str | None, dict[str, str], dict[str, Any] | None]:
    """The AMD labeller's `amd.com/gpu.<name>`: (value, the nodeSelector that picks it, or the Exists expression
    for the oldest value-in-the-key form). Newest form first; a node with mixed GPU kinds (several values in the
    key form) reads as unknown."""
    for key in (f"amd.com/gpu.{name}", f"{AMD_BETA}amd.com/gpu.{name}"):
        if labels.get(key):
            return labels[key], {key: labels[key]}, None
    prefix = f"{AMD_BETA}amd.com/gpu.{name}."
    keyed = [key for key in labels if key.startswith(prefix)]
    if len(keyed) == 1:
        return keyed[0][len(prefix):], {}, {"key": keyed[0], "operator": "Exists"}
    return None, {}, None


def _amd_gpu(labels: Mapping[str, str], allocatable: Mapping[str, Any]) -> dict[str, Any]:
    """The NodeInfo fields of a node with allocatable amd.com/gpu."""
    product, product_selector, product_expression = amd_label(labels, "product-name")
    family = amd_label(labels, "family")[0]
    vram, vram_selector, vram_expression = amd_label(labels, "vram")
    match = _VRAM_GIB.match(vram or "")
    cu_count = amd_label(labels, "cu-count")[0]
    name = product or (f"AMD-{family}" if family else "AMD-GPU")
    return {
        "gpu_vendor": "amd",
        "gpu_product": name,
        "gpu_memory_mib": int(match.group(1)) * 1024 if match else 0,
        "num_gpus": int(parse_quantity(allocatable[AMD_GPU_RESOURCE])),
        "gpu_bf16": bool(_AMD_BF16.search(name)),
        "gpu_cu_count": int(cu_count) if cu_count and cu_count.isdigit() else 0,
        "gpu_selector": {**product_selector, **vram_selector},
        "gpu_expressions": tuple(e for e in (product_expression, vram_expression) if e),
    }


def node_info(node: Mapping[str, Any]) -> NodeInfo:
    """Parse a v1 Node object (as a dict) into a NodeInfo."""
    metadata = node.get("metadata") or {}
    labels = dict(metadata.get("labels") or {})
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    allocatable = status.get("allocatable") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    common = {
        "name": metadata.get("name", ""),
        "labels": labels,
        "ready": ready,
        "schedulable": not spec.get("unschedulable", False),
        "taints": tuple(spec.get("taints") or ()),
        "arch": labels.get(ARCH, "amd64"),
        "cpu_bf16": labels.get(CPU_AVX512BF16) == "true" or labels.get(CPU_AMXBF16) == "true",
        "cpu_amx": labels.get(CPU_AMXBF16) == "true",
        "memory_bytes": int(parse_quantity(allocatable.get("memory", 0))),
        "cpu_millis": int(parse_quantity(allocatable.get("cpu", 0)) * 1000),
        "pool_label": labels.get(NODE_POOL_LABEL),
    }
    if GPU_PRODUCT not in labels and int(parse_quantity(allocatable.get(AMD_GPU_RESOURCE, 0))) > 0:
        return NodeInfo(**common, **_amd_gpu(labels, allocatable))
    product = labels.get(GPU_PRODUCT)
    num_gpus = int(parse_quantity(allocatable[GPU_RESOURCE])) if GPU_RESOURCE in allocatable else 0
    if GPU_RESOURCE not in allocatable:
        num_gpus = _int_label(labels, GPU_COUNT)
    if GPU_COMPUTE_MAJOR in labels:
        gpu_bf16 = _int_label(labels, GPU_COMPUTE_MAJOR) >= 8
    else:
        gpu_bf16 = product is not None and not _PRE_AMPERE.search(product)
    memory_mib = _int_label(labels, GPU_MEMORY_MIB)
    selector = {GPU_PRODUCT: product, GPU_MEMORY_MIB: str(memory_mib)} if product else {}
    return NodeInfo(**common, gpu_product=product, gpu_memory_mib=memory_mib, num_gpus=num_gpus, gpu_bf16=gpu_bf16,
                    gpu_selector=selector)  # fmt: skip


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
    gpu_vendor: str = "nvidia"  # nvidia | amd: the resource pods request, the taint they tolerate, the image
    gpu_cu_count: int = 0
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

    @property
    def gpu_resource(self) -> str:
        """The extended resource one GPU of this pool is requested as."""
        return GPU_RESOURCES[self.gpu_vendor]

    def describe(self) -> str:
        if self.device == "cuda":
            cus = f", {self.gpu_cu_count} CUs" if self.gpu_cu_count else ""
            return (f"{self.num_nodes} node(s) x {self.max_gpus_per_node} {self.gpu_product} "
                    f"({self.gpu_memory_mib} MiB{cus})")  # fmt: skip
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
    tolerations = list(tolerations) + ([GPU_TOLERATIONS[node.gpu_vendor]] if node.gpu_product else [])
    for taint in node.taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(
            toleration_matches(t, taint) for t in tolerations
        ):
            return False, f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} not tolerated"
    return True, ""


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return re.sub(r"^(amd-(instinct-)?|(nvidia-)?(tesla-)?)", "", slug) or "unknown"


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
        return dict(node.gpu_selector), (*node.gpu_expressions, not_labelled)
    bf16 = (
        {"key": CPU_AVX512BF16, "operator": "In", "values": ["true"]}
        if node.cpu_bf16 and node.labels.get(CPU_AVX512BF16) == "true"
        else {"key": CPU_AMXBF16, "operator": "In", "values": ["true"]}
        if node.cpu_bf16
        else {"key": CPU_AVX512BF16, "operator": "DoesNotExist"}
    )
    no_gpu = {"key": GPU_PRODUCT, "operator": "DoesNotExist"}
    no_amd_gpu = {"key": AMD_PRODUCT, "operator": "DoesNotExist"}
    return {ARCH: node.arch}, (no_gpu, no_amd_gpu, bf16, not_labelled)


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
                gpu_vendor=first.gpu_vendor,
                gpu_cu_count=first.gpu_cu_count,
                arch=first.arch,
                cpu_bf16=all(n.cpu_bf16 for n in members),
                cpu_amx=all(n.cpu_amx for n in members),
                memory_bytes_per_node=tuple(n.memory_bytes for n in members),
                node_selector={**selector, **node_selector},
                match_expressions=expressions,
                tolerations=tolerations + ((GPU_TOLERATIONS[first.gpu_vendor],) if is_gpu else ()),
                instance_type=_shared(n.labels.get(INSTANCE_TYPE) for n in members),
            )
        )
    return sorted(pools, key=lambda p: p.name)
