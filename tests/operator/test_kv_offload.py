"""The host KV tier in the operator: spec.engine.kvOffloadMemory ("auto" from the node's memory on GPU pools,
a fixed quantity, or 0), split over a replica's GPUs as --kv-offload-bytes and added to its memory request."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.utils import parse_quantity

from hpi_operator.nodes import group_pools, node_info
from hpi_operator.plan import make_plan
from hpi_operator.profiles import GPU_HOST_MEMORY_BYTES, KV_OFFLOAD_MAX_KV_MULTIPLE, choose_profile
from hpi_operator.sizing import GIB, model_shape
from hpi_operator.spec import SpecError, parse_spec
from hpi_testing.kube_emulator import H100, make_node

LLAMA_8B = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}}
LLAMA_70B = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-70B-Instruct"}}


def profile_for(node: dict[str, Any], **spec: Any):
    [pool] = group_pools([node_info(node)])
    parsed = parse_spec(spec)
    return choose_profile(pool, parsed, model_shape(parsed.model)).profile


def one_h100(memory: str) -> dict[str, Any]:
    product, memory_mib, _ = H100
    return make_node("g", gpu=(product, memory_mib, 1), memory=memory)


def test_auto_takes_half_the_spare_node_memory_up_to_four_times_the_kv_cache() -> None:
    roomy = profile_for(one_h100("1Ti"), model=LLAMA_8B)
    assert roomy.kv_offload_bytes == KV_OFFLOAD_MAX_KV_MULTIPLE * roomy.kv_cache_bytes  # capped by the KV cache
    tight = profile_for(one_h100("40Gi"), model=LLAMA_8B)
    assert tight.kv_offload_bytes == (40 * GIB - GPU_HOST_MEMORY_BYTES) // 2
    assert profile_for(one_h100("9Gi"), model=LLAMA_8B).kv_offload_bytes == 0  # under 1Gi left: none
    # Eight replicas share an 8-GPU node's memory: each gets a slice.
    product, memory_mib, _ = H100
    shared = profile_for(make_node("g", gpu=(product, memory_mib, 8), memory="256Gi"), model=LLAMA_8B)
    assert shared.kv_offload_bytes == (32 * GIB - GPU_HOST_MEMORY_BYTES) // 2


def test_cpu_pools_get_no_host_tier_unless_asked() -> None:
    assert profile_for(make_node("c", bf16=True, memory="64Gi")).kv_offload_bytes == 0
    asked = profile_for(make_node("c", bf16=True, memory="64Gi"), engine={"kvOffloadMemory": "2Gi"})
    assert asked.kv_offload_bytes == 2 * GIB


def test_a_fixed_size_is_split_over_the_replicas_gpus_and_added_to_its_memory() -> None:
    product, memory_mib, _ = H100
    nodes = [node_info(make_node("g", gpu=(product, memory_mib, 8), memory="2Ti"))]
    spec = {"model": LLAMA_70B, "placement": {"maxGpusPerReplica": 8}, "engine": {"kvOffloadMemory": "64Gi"}}
    cr = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
          "metadata": {"name": "big", "namespace": "ml", "uid": "u"}, "spec": spec}  # fmt: skip
    plan = make_plan(cr, nodes)
    [deployment] = plan.deployments
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    num_gpus = int(args[args.index("--tensor-parallel-size") + 1])
    assert num_gpus > 1
    assert int(args[args.index("--kv-offload-bytes") + 1]) == 64 * GIB // num_gpus
    memory = parse_quantity(container["resources"]["requests"]["memory"])
    assert memory == GPU_HOST_MEMORY_BYTES + 64 * GIB
    assert container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"]


def test_zero_turns_it_off_and_the_flag_is_left_out() -> None:
    product, memory_mib, _ = H100
    nodes = [node_info(make_node("g", gpu=(product, memory_mib, 1), memory="1Ti"))]
    for value, expect_flag in (("0", False), ("auto", True)):
        cr = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
              "metadata": {"name": "d", "namespace": "ml", "uid": "u"},
              "spec": {"model": LLAMA_8B, "engine": {"kvOffloadMemory": value}}}  # fmt: skip
        [deployment] = make_plan(cr, nodes).deployments
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert ("--kv-offload-bytes" in args) == expect_flag, value


@pytest.mark.parametrize("value", ["lots", "-1Gi", "1.5.5"])
def test_a_bad_size_is_a_spec_error(value: str) -> None:
    with pytest.raises(SpecError, match="kvOffloadMemory"):
        parse_spec({"engine": {"kvOffloadMemory": value}})
