"""Node inventory: GFD/NFD labels -> NodeInfo; usable nodes -> pools."""

from __future__ import annotations

from hpi_operator.nodes import GPU_TOLERATION, group_pools, node_info, node_usable
from hpi_testing.kube_emulator import A100_40, A100_80, H100, L4, T4, make_node


def infos(*nodes):
    return [node_info(n) for n in nodes]


def test_gpu_node_labels_parse() -> None:
    info = node_info(make_node("g", gpu=H100))
    assert (info.gpu_product, info.gpu_memory_mib, info.num_gpus) == ("NVIDIA-H100-80GB-HBM3", 81559, 8)
    assert info.gpu_bf16 and info.ready and info.schedulable


def test_allocatable_gpus_win_over_the_count_label() -> None:
    node = make_node("g", gpu=H100)
    node["status"]["allocatable"]["nvidia.com/gpu"] = "6"  # two GPUs held back by the device plugin
    assert node_info(node).num_gpus == 6


def test_pre_ampere_gpus_have_no_bf16_with_or_without_the_compute_label() -> None:
    assert not node_info(make_node("t", gpu=T4)).gpu_bf16
    labelled = make_node("x", gpu=("NVIDIA-Future", 50000, 1), labels={"nvidia.com/gpu.compute.major": "7"})
    assert not node_info(labelled).gpu_bf16
    assert node_info(make_node("l", gpu=L4)).gpu_bf16


def test_cpu_bf16_from_nfd_flags() -> None:
    assert node_info(make_node("c", bf16=True)).cpu_bf16
    assert not node_info(make_node("c")).cpu_bf16
    amx_only = make_node("c", labels={"feature.node.kubernetes.io/cpu-cpuid.AMXBF16": "true"})
    assert node_info(amx_only).cpu_bf16


def test_pools_group_by_accelerator_and_cpu_features() -> None:
    pools = group_pools(
        infos(
            make_node("h1", gpu=H100),
            make_node("h2", gpu=H100),
            make_node("l1", gpu=L4),
            make_node("c1", bf16=True),
            make_node("c2"),
            make_node("c3"),
        )
    )
    by_name = {p.name: p for p in pools}
    assert sorted(by_name) == ["cpu-amd64", "cpu-amd64-bf16", "gpu-h100-80gb-hbm3", "gpu-l4"]
    assert by_name["gpu-h100-80gb-hbm3"].node_names == ("h1", "h2")
    assert by_name["gpu-h100-80gb-hbm3"].gpus_per_node == (8, 8)
    assert by_name["cpu-amd64"].num_nodes == 2
    assert by_name["gpu-l4"].node_selector == {"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.memory": "23034"}
    assert GPU_TOLERATION in by_name["gpu-l4"].tolerations
    assert by_name["cpu-amd64"].tolerations == ()
    # The plain CPU pool must not land on bf16 CPUs or GPU nodes: affinity excludes them.
    expressions = {e["key"]: e["operator"] for e in by_name["cpu-amd64"].match_expressions}
    assert expressions["feature.node.kubernetes.io/cpu-cpuid.AVX512BF16"] == "DoesNotExist"
    assert expressions["nvidia.com/gpu.product"] == "DoesNotExist"


def test_same_product_different_memory_gets_distinct_names() -> None:
    odd = ("NVIDIA-A100-SXM4", 40960, 8)
    pools = group_pools(infos(make_node("a", gpu=odd), make_node("b", gpu=(odd[0], 81920, 8))))
    assert [p.name for p in pools] == ["gpu-a100-sxm4-40g", "gpu-a100-sxm4-80g"]
    assert [p.name for p in group_pools(infos(make_node("a", gpu=A100_40), make_node("b", gpu=A100_80)))] == [
        "gpu-a100-sxm4-40gb",
        "gpu-a100-sxm4-80gb",
    ]


def test_not_ready_unschedulable_and_untolerated_nodes_are_skipped() -> None:
    nodes = infos(
        make_node("ok"),
        make_node("down", ready=False),
        make_node("cordoned", unschedulable=True),
        make_node("tainted", taints=[{"key": "dedicated", "value": "batch", "effect": "NoSchedule"}]),
        make_node("soft", taints=[{"key": "dedicated", "value": "batch", "effect": "PreferNoSchedule"}]),
    )
    assert group_pools(nodes)[0].node_names == ("ok", "soft")
    tolerated = group_pools(nodes, tolerations=[{"key": "dedicated", "operator": "Equal", "value": "batch"}])
    assert tolerated[0].node_names == ("ok", "soft", "tainted")
    assert node_usable(nodes[1], {}, [])[1] == "NotReady"


def test_gpu_nodes_tainted_for_gpus_are_usable_by_default() -> None:
    node = make_node("g", gpu=L4, taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}])
    assert group_pools(infos(node))[0].name == "gpu-l4"


def test_node_selector_filters_nodes_and_reaches_the_pool() -> None:
    nodes = infos(make_node("a", labels={"team": "ml"}), make_node("b"))
    [pool] = group_pools(nodes, node_selector={"team": "ml"})
    assert pool.node_names == ("a",)
    assert pool.node_selector["team"] == "ml"


def test_explicit_pool_label_overrides_grouping() -> None:
    nodes = infos(make_node("a", gpu=L4, labels={"serving.hpi.dev/pool": "edge"}), make_node("b", gpu=L4))
    pools = {p.name: p for p in group_pools(nodes)}
    assert pools["edge"].node_names == ("a",)
    assert pools["edge"].node_selector == {"serving.hpi.dev/pool": "edge"}
    assert pools["gpu-l4"].node_names == ("b",)
    assert {"key": "serving.hpi.dev/pool", "operator": "DoesNotExist"} in pools["gpu-l4"].match_expressions
