"""AMD GPU pools: nodes with allocatable amd.com/gpu and the ROCm node labeller's labels (all three of its label
forms) become pools with the same memory arithmetic, precision and tensor parallelism as NVIDIA's; their pods request
amd.com/gpu, tolerate its taint and run the ROCm runtime image; the optimizer assumes their speed from AMD's
datasheet figures."""

from __future__ import annotations

from typing import Any

import pytest

from hpi_operator.fleet.assumed import GPU_FIGURES, assumed_performance, gpu_figures
from hpi_operator.nodes import AMD_GPU_TOLERATION, GPU_TOLERATION, group_pools, node_info
from hpi_operator.plan import make_plan
from hpi_operator.profiles import choose_profile
from hpi_operator.sizing import model_shape
from hpi_operator.spec import parse_spec
from hpi_testing.kube_emulator import L4, make_node

# Label values as the ROCm k8s-device-plugin's node labeller writes them (cmd/k8s-node-labeller/main.go: spaces in
# the product name become underscores, VRAM in GiB with a G).
MI300X = ("AMD_Instinct_MI300X_OAM", 192, 8, 304)
MI325X = ("AMD_Instinct_MI325_OAM", 256, 8, 304)
MI210 = ("AMD_Instinct_MI210", 64, 4, 104)
MI50 = ("AMD_Instinct_MI50", 32, 4, 60)
LLAMA_70B = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-70B-Instruct"}}
LLAMA_8B = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}}


def amd_node(name: str, gpu: tuple[str, int, int, int], form: str = "current", taint: bool = True,
             **extra: Any) -> dict[str, Any]:  # fmt: skip
    """A node as the AMD device plugin and node labeller leave it. `form`: current (amd.com/gpu.* plus the beta
    copies), beta (an older labeller: beta.amd.com/gpu.* only) or oldest (the value inside the key)."""
    product, vram_gib, count, cus = gpu
    values = {"product-name": product, "vram": f"{vram_gib}G", "family": "AI", "cu-count": str(cus)}
    labels: dict[str, str] = {}
    for name_, value in values.items():
        if form == "current":
            labels[f"amd.com/gpu.{name_}"] = value
        if form in ("current", "beta"):
            labels[f"beta.amd.com/gpu.{name_}"] = value
        labels[f"beta.amd.com/gpu.{name_}.{value}"] = str(count)
    node = make_node(name, labels=labels, **extra)
    node["status"]["allocatable"]["amd.com/gpu"] = str(count)
    if taint:
        node["spec"]["taints"] = [{"key": "amd.com/gpu", "effect": "NoSchedule"}]
    return node


def test_the_labellers_labels_give_product_memory_count_and_precision() -> None:
    info = node_info(amd_node("mi300x-0", MI300X))
    assert (info.gpu_vendor, info.gpu_product, info.gpu_memory_mib, info.num_gpus) == (
        "amd", "AMD_Instinct_MI300X_OAM", 192 * 1024, 8)
    assert info.gpu_bf16 and info.gpu_cu_count == 304
    assert info.gpu_selector == {"amd.com/gpu.product-name": "AMD_Instinct_MI300X_OAM", "amd.com/gpu.vram": "192G"}
    assert not node_info(amd_node("mi50-0", MI50)).gpu_bf16  # Vega 20 (gfx906): no bf16 matrix instructions


@pytest.mark.parametrize("form", ["beta", "oldest"])
def test_older_labellers_forms_read_the_same(form: str) -> None:
    info = node_info(amd_node("mi210-0", MI210, form=form))
    assert (info.gpu_product, info.gpu_memory_mib, info.num_gpus) == ("AMD_Instinct_MI210", 64 * 1024, 4)
    if form == "beta":
        assert info.gpu_selector == {"beta.amd.com/gpu.product-name": "AMD_Instinct_MI210",
                                     "beta.amd.com/gpu.vram": "64G"}  # fmt: skip
    else:  # only the value-in-the-key labels: select on their existence
        assert info.gpu_selector == {} and {e["key"] for e in info.gpu_expressions} == {
            "beta.amd.com/gpu.product-name.AMD_Instinct_MI210", "beta.amd.com/gpu.vram.64G"}


def test_amd_and_nvidia_nodes_make_separate_pools_each_tolerating_its_own_taint() -> None:
    nodes = [node_info(amd_node("mi300x-0", MI300X)), node_info(amd_node("mi300x-1", MI300X)),
             node_info(make_node("l4-0", gpu=L4)), node_info(make_node("cpu-0"))]  # fmt: skip
    pools = {p.name: p for p in group_pools(nodes)}
    assert set(pools) == {"gpu-mi300x-oam", "gpu-l4", "cpu-amd64"}
    amd = pools["gpu-mi300x-oam"]
    assert (amd.device, amd.gpu_vendor, amd.gpu_resource, amd.num_nodes) == ("cuda", "amd", "amd.com/gpu", 2)
    assert AMD_GPU_TOLERATION in amd.tolerations and GPU_TOLERATION not in amd.tolerations
    assert pools["gpu-l4"].gpu_resource == "nvidia.com/gpu"
    assert "304 CUs" in amd.describe()
    # a CPU pool never schedules onto an AMD GPU node
    assert {"key": "amd.com/gpu.product-name", "operator": "DoesNotExist"} in pools["cpu-amd64"].match_expressions


def choose(gpu: tuple[str, int, int, int], model: dict[str, Any], max_gpus: int) -> str | None:
    [pool] = group_pools([node_info(amd_node("n", gpu))])
    spec = parse_spec({"model": model, "placement": {"maxGpusPerReplica": max_gpus}})
    choice = choose_profile(pool, spec, model_shape(spec.model))
    return choice.profile.label() if choice.profile else None


def test_the_memory_arithmetic_chooses_precision_and_tensor_parallelism_as_for_nvidia() -> None:
    # 70B in bf16 is ~131 GiB of weights: one 192 GiB MI300X holds it with room for KV; the 141 GB H200 needs int8.
    assert choose(MI300X, LLAMA_70B, 1) == "cuda:bf16"
    # 64 GiB MI210s: three would do by bytes, but 8 KV heads split over 4, not 3 (as 70B on 80 GB H100s).
    assert choose(MI210, LLAMA_70B, 8) == "cuda:bf16 x4"
    assert choose(MI210, LLAMA_70B, 1) == "cuda:bf16/int4"
    assert choose(MI50, LLAMA_8B, 1) == "cuda:fp16"  # no bf16 on the MI50: fp16, as a T4


def cr(**runtime: Any) -> dict[str, Any]:
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "mixed", "namespace": "default", "uid": "u-1"},
            "spec": {"replicas": 2, "model": LLAMA_8B, "runtime": runtime}}  # fmt: skip


def deployments(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    nodes = [node_info(amd_node("mi300x-0", MI300X)), node_info(make_node("l4-0", gpu=L4))]
    plan = make_plan(body, nodes)
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in plan.deployments}


def test_an_amd_pools_pods_request_amd_gpus_tolerate_their_taint_and_run_the_rocm_image() -> None:
    pods = deployments(cr())
    amd, nvidia = pods["mixed-gpu-mi300x-oam"], pods["mixed-gpu-l4"]
    container = amd["containers"][0]
    assert container["resources"]["limits"]["amd.com/gpu"] == "1" and "nvidia.com/gpu" not in container["resources"]
    assert container["resources"]["requests"]["amd.com/gpu"] == "1"
    assert container["image"] == "ghcr.io/hetero-paged-infer/runtime:0.1.0-rocm"  # the CRD's default
    assert all(c["image"] == container["image"] for c in amd.get("initContainers", []))  # one image per node
    assert AMD_GPU_TOLERATION in amd["tolerations"]
    assert amd["nodeSelector"]["amd.com/gpu.product-name"] == "AMD_Instinct_MI300X_OAM"
    assert "--device" not in container["args"] or container["args"][container["args"].index("--device") + 1] == "cuda"
    assert nvidia["containers"][0]["image"] == "ghcr.io/hetero-paged-infer/runtime:0.1.0"
    assert nvidia["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pinned = deployments(cr(image="registry.example.com/hpi:1", rocmImage="registry.example.com/hpi:1-rocm"))
    assert pinned["mixed-gpu-mi300x-oam"]["containers"][0]["image"] == "registry.example.com/hpi:1-rocm"
    assert pinned["mixed-gpu-l4"]["containers"][0]["image"] == "registry.example.com/hpi:1"


def test_the_optimizer_assumes_instinct_speeds_from_amds_datasheets() -> None:
    assert gpu_figures("AMD_Instinct_MI325_OAM") == dict(GPU_FIGURES)["MI325"]  # the labeller drops MI325X's X
    assert gpu_figures("AMD_Instinct_MI300X_OAM").memory_bandwidth_gbps == 5300
    assert gpu_figures("AMD_Instinct_MI300A") is None  # the APU is not an MI300X
    [pool] = group_pools([node_info(amd_node("n", MI300X))])
    spec = parse_spec({"model": LLAMA_8B})
    shape = model_shape(spec.model)
    profile = choose_profile(pool, spec, shape).profile
    assert profile is not None
    mi300x = assumed_performance(pool.gpu_product, profile, shape, 1000)
    mi325x = assumed_performance("AMD_Instinct_MI325_OAM", profile, shape, 1000)
    assert mi300x is not None and mi325x is not None and mi300x.source == "assumed"
    # decode is bandwidth-bound: the same weights cost 6.0/5.3 less per step on the MI325X's faster HBM
    assert mi300x.itl_alpha_s / mi325x.itl_alpha_s == pytest.approx(6000 / 5300)
