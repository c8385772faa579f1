"""Profile choice over node shapes x model sizes, pins and forbids, and the no-fit outcome."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpi_operator.nodes import group_pools, node_info
from hpi_operator.profiles import PoolChoice, choose_profile
from hpi_operator.sizing import GIB, model_shape, weight_bytes
from hpi_operator.spec import SpecError, parse_spec
from hpi_testing.kube_emulator import A10, A100_40, A100_80, H100, H200, L4, T4, make_node

MODELS: dict[str, dict[str, Any]] = {
    "135m": {"source": "embedded"},
    "8b": {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}},
    "70b": {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-70B-Instruct"}},
}
NODES = {
    "H200": dict(gpu=H200),
    "H100": dict(gpu=H100),
    "A100-80": dict(gpu=A100_80),
    "A100-40": dict(gpu=A100_40),
    "A10": dict(gpu=A10),
    "L4": dict(gpu=L4),
    "T4": dict(gpu=T4),
    "cpu-bf16": dict(bf16=True, memory="64Gi"),  # AVX512-BF16 and AMX
    "cpu-avx512bf16": dict(labels={"feature.node.kubernetes.io/cpu-cpuid.AVX512BF16": "true"}, memory="64Gi"),
    "cpu": dict(memory="64Gi"),
    "cpu-32": dict(memory="32Gi"),
    "cpu-small": dict(memory="16Gi"),
}


def choose(node: str, model: str, **spec: Any) -> PoolChoice:
    [pool] = group_pools([node_info(make_node("n", **NODES[node]))])
    parsed = parse_spec({"model": MODELS[model], **spec})
    return choose_profile(pool, parsed, model_shape(parsed.model))


# (node, model, max GPUs per replica) -> device:dtype[/quantization][ xGPUs], or None for "does not fit".
TABLE = [
    ("H200", "135m", 1, "cuda:bf16"),
    ("H200", "8b", 1, "cuda:bf16"),
    ("H200", "70b", 1, "cuda:bf16/int8"),
    ("H200", "70b", 8, "cuda:bf16 x2"),
    ("H100", "8b", 1, "cuda:bf16"),
    ("H100", "70b", 1, "cuda:bf16/int4"),
    ("H100", "70b", 8, "cuda:bf16 x4"),
    ("A100-80", "135m", 1, "cuda:bf16"),
    ("A100-80", "8b", 1, "cuda:bf16"),
    ("A100-80", "70b", 1, "cuda:bf16/int4"),
    ("A100-40", "135m", 1, "cuda:bf16"),
    ("A100-40", "8b", 1, "cuda:bf16"),
    ("A100-40", "70b", 1, None),
    ("A100-40", "70b", 8, "cuda:bf16 x8"),
    ("A10", "8b", 1, "cuda:bf16"),
    ("L4", "135m", 1, "cuda:bf16"),
    ("L4", "8b", 1, "cuda:bf16"),
    ("L4", "70b", 8, None),
    ("T4", "135m", 1, "cuda:fp16"),
    ("T4", "8b", 1, "cuda:fp16/int8"),
    ("T4", "70b", 1, None),
    ("cpu-bf16", "135m", 1, "cpu:bf16"),
    ("cpu-bf16", "8b", 1, "cpu:bf16"),
    ("cpu-bf16", "70b", 1, "cpu:bf16/int4"),
    # AVX512-BF16 without AMX: bf16 too (the runtime's packed bf16 linears are faster than fp32 there).
    ("cpu-avx512bf16", "135m", 1, "cpu:bf16"),
    ("cpu-avx512bf16", "70b", 1, "cpu:bf16/int4"),
    ("cpu", "135m", 1, "cpu:fp32"),
    ("cpu", "8b", 1, "cpu:fp32"),
    ("cpu", "70b", 1, "cpu:fp32/int4"),  # int4 48 GiB (embedding fp32, head bf16) + 2.5 GiB fp32 KV fit 64 GiB
    # Llama's bf16 checkpoint: the runtime keeps an fp32 replica's linears in bf16 panels (16 GiB of weights, not 30).
    ("cpu-32", "8b", 1, "cpu:fp32"),
    ("cpu-small", "8b", 1, "cpu:fp32/int8"),
    ("cpu-small", "70b", 1, None),
]


@pytest.mark.parametrize(("node", "model", "max_gpus", "expected"), TABLE)
def test_profile_table(node: str, model: str, max_gpus: int, expected: str | None) -> None:
    choice = choose(node, model, placement={"maxGpusPerReplica": max_gpus})
    assert (choice.profile.label() if choice.profile else None) == expected, choice.reason
    if choice.profile is None:
        assert choice.reason.startswith("does not fit"), choice.reason
    else:
        profile = choice.profile
        assert profile.needed_bytes <= profile.memory_budget_bytes
        assert profile.kv_cache_bytes >= 4096 * 2 * 16  # at least one 4096-token sequence of the smallest model
        assert choice.capacity >= 1
        assert profile.label() in choice.reason


def test_reason_explains_the_arithmetic_and_the_fallback() -> None:
    choice = choose("T4", "8b")
    assert "weights" in choice.reason and "min KV" in choice.reason and "overhead" in choice.reason
    assert "none did not fit" in choice.reason
    assert "Tesla-T4" in choice.reason


A4000_X2 = ("NVIDIA-RTX-A4000", 16376, 2)  # a 16 GB Ampere GPU, two per node


def choose_on(gpu: tuple[str, int, int], model: dict[str, Any], **spec: Any) -> PoolChoice:
    [pool] = group_pools([node_info(make_node("n", gpu=gpu))])
    parsed = parse_spec({"model": model, **spec})
    return choose_profile(pool, parsed, model_shape(parsed.model))


def hinted(num_heads: int | None, num_kv_heads: int) -> dict[str, Any]:
    """An 8B-sized model behind a PVC, with the head counts under test."""
    size = {"parameters": "8B", "numLayers": 32, "numKVHeads": num_kv_heads, "headDim": 128}
    if num_heads is not None:
        size["numHeads"] = num_heads
    return {"source": "pvc", "pvc": {"claimName": "w"}, "size": size}


def test_8b_bf16_too_big_for_one_16gb_gpu_splits_over_two() -> None:
    choice = choose_on(A4000_X2, MODELS["8b"])  # the default lets a replica span a node's GPUs
    assert choice.profile is not None and choice.profile.label() == "cuda:bf16 x2", choice.reason
    assert choice.profile.num_gpus == 2 and choice.capacity == 1
    assert choice.reason.startswith("cuda:bf16 x2 (tensor parallel over 2 GPUs: 1 x NVIDIA-RTX-A4000 is not enough, ")
    assert "did not fit" not in choice.reason  # bf16 itself fitted, on two GPUs
    # Limited to one GPU per replica, the same pool quantizes instead.
    single = choose_on(A4000_X2, MODELS["8b"], placement={"maxGpusPerReplica": 1})
    assert single.profile is not None and single.profile.label() == "cuda:bf16/int8", single.reason
    assert "tensor parallel" not in single.reason


def test_tensor_parallel_reason_names_the_largest_count_that_was_not_enough() -> None:
    choice = choose("H100", "70b", placement={"maxGpusPerReplica": 8})
    assert choice.reason.startswith("cuda:bf16 x4 (tensor parallel over 4 GPUs: 2 x NVIDIA-H100-80GB-HBM3 is not")


def test_heads_that_cannot_split_over_two_gpus_keep_one_gpu_and_say_why() -> None:
    # 3 query heads over 1 KV head split over 1 or 3 ranks only: x2 would fit the memory but not the model.
    choice = choose_on(A4000_X2, hinted(3, 1), placement={"maxGpusPerReplica": 2})
    assert choice.profile is not None and choice.profile.label() == "cuda:bf16/int8", choice.reason
    assert "x2 not offered: 3 attention heads over 1 KV head split only over 1 or 3 GPUs" in choice.reason
    splittable = choose_on(A4000_X2, hinted(4, 1), placement={"maxGpusPerReplica": 2})
    assert splittable.profile is not None and splittable.profile.label() == "cuda:bf16 x2", splittable.reason
    assert "not offered" not in splittable.reason


def test_heads_that_cannot_split_are_named_when_nothing_fits() -> None:
    choice = choose_on(("NVIDIA-L4", 23034, 8), {**hinted(3, 1), "size": {**hinted(3, 1)["size"], "parameters": "70B"}},
                       placement={"maxGpusPerReplica": 8})  # fmt: skip
    assert choice.profile is None
    assert choice.reason.startswith("does not fit: even bf16/int4 needs")
    assert "x2, x4, x8 not offered: 3 attention heads over 1 KV head" in choice.reason


def test_without_num_heads_no_replica_splits_beyond_the_kv_heads() -> None:
    choice = choose_on(A4000_X2, hinted(None, 1), placement={"maxGpusPerReplica": 2})
    assert choice.profile is not None and choice.profile.num_gpus == 1, choice.reason
    assert "x2 not offered: spec.model.size.numHeads is unknown" in choice.reason
    two_kv_heads = choose_on(A4000_X2, hinted(None, 2), placement={"maxGpusPerReplica": 2})
    assert two_kv_heads.profile is not None and two_kv_heads.profile.label() == "cuda:bf16 x2"


def test_no_fit_on_one_gpu_suggests_more_gpus_per_replica_when_nodes_have_them() -> None:
    choice = choose("A100-40", "70b", placement={"maxGpusPerReplica": 1})
    assert choice.profile is None
    assert "raise spec.placement.maxGpusPerReplica" in choice.reason
    assert "maxGpusPerReplica" not in choose("L4", "70b").reason  # one GPU per node: nothing to raise
    unsplittable = choose_on(A100_40, {**hinted(3, 1), "size": {**hinted(3, 1)["size"], "parameters": "70B"}})
    assert unsplittable.profile is None and "maxGpusPerReplica" not in unsplittable.reason  # x2-x8 cannot split it
    closest = choose_on(("NVIDIA-L4", 23034, 2), MODELS["70b"], placement={"maxGpusPerReplica": 2})
    assert closest.profile is None and closest.reason.startswith("does not fit: even bf16/int4 over 2 GPUs needs")


def test_no_fit_reason_names_the_smallest_need() -> None:
    choice = choose("L4", "70b")
    assert choice.profile is None
    assert "int4" in choice.reason and "GiB" in choice.reason


def test_quantized_weights_shrink_as_expected() -> None:
    shape = model_shape(parse_spec({"model": MODELS["8b"]}).model)
    bf16, int8, int4 = (weight_bytes(shape, "bf16", q) for q in ("none", "int8", "int4"))
    assert 14.9 * GIB < bf16 < 15.0 * GIB
    # The embedding and Llama's untied LM head stay bf16 (the runtime quantizes the head only with
    # --quantize-lm-head); the layers' linears take 1 byte (int8) or 0.625 (int4: a 16-bit scale and zero per 32),
    # except q/k/v, which int4's default policy ("mixed") keeps at int8: 32 layers x 4096 x (4096 + 2 x 1024).
    vocabulary, qkv = 128256 * 4096, 32 * 4096 * (4096 + 2 * 1024)
    layers = shape.num_parameters - 2 * vocabulary
    assert int8 == layers + 2 * vocabulary * 2
    assert int4 == math.ceil((layers - qkv) * 0.625) + qkv + 2 * vocabulary * 2
    assert 0.56 * bf16 < int8 < 0.57 * bf16 and 0.42 * bf16 < int4 < 0.43 * bf16


def test_capacity_counts_whole_replicas_per_node() -> None:
    assert choose("H100", "8b").capacity == 8  # 8 GPUs, one per replica
    assert choose("H100", "70b", placement={"maxGpusPerReplica": 8}).capacity == 2  # 4 GPUs per replica


@pytest.mark.parametrize(
    ("placement", "node", "expected"),
    [
        ({"profile": {"quantization": "int8"}}, "H100", "cuda:bf16/int8"),
        ({"profile": {"quantization": "int4"}}, "cpu-bf16", "cpu:bf16/int4"),
        ({"profile": {"dtype": "fp32"}}, "cpu-bf16", "cpu:fp32"),
        ({"profile": {"dtype": "fp16"}}, "L4", "cuda:fp16"),
        ({"profile": {"device": "cuda"}}, "cpu", None),
        ({"profile": {"device": "cpu"}}, "L4", None),
        ({"profile": {"dtype": "bf16"}}, "T4", None),
        ({"profile": {"dtype": "bf16"}}, "cpu", None),
        ({"profile": {"dtype": "fp32"}}, "cpu-avx512bf16", "cpu:fp32"),
        ({"forbiddenQuantizations": ["int4"], "maxGpusPerReplica": 1}, "A100-40", None),
        ({"forbiddenQuantizations": ["none"]}, "H100", "cuda:bf16/int8"),
    ],
)
def test_pins_and_forbids(placement: dict[str, Any], node: str, expected: str | None) -> None:
    model = "70b" if node == "A100-40" else "8b"
    choice = choose(node, model, placement=placement)
    assert (choice.profile.label() if choice.profile else None) == expected, choice.reason


def test_forbidding_int4_leaves_70b_on_one_h100_without_a_profile() -> None:
    choice = choose("H100", "70b", placement={"forbiddenQuantizations": ["int4"], "maxGpusPerReplica": 1})
    assert choice.profile is None and "does not fit" in choice.reason


def test_pinned_quantization_that_cannot_fit() -> None:
    choice = choose("L4", "70b", placement={"profile": {"quantization": "none"}})
    assert choice.profile is None
    assert "none" in choice.reason


def test_kv_cache_is_capped_at_what_max_num_seqs_can_use() -> None:
    choice = choose("H200", "135m", engine={"maxNumSeqs": 1, "maxModelLen": 1024})
    assert choice.profile is not None
    assert choice.profile.kv_cache_bytes == 1024 * 2 * 30 * 3 * 64 * 2


def test_cpu_memory_limit_in_resources_bounds_the_budget() -> None:
    choice = choose("cpu-bf16", "8b", resources={"limits": {"memory": "12Gi"}})
    assert choice.profile is not None and choice.profile.quantization == "int8"


def test_longer_context_needs_more_kv_and_can_push_a_model_down_a_precision() -> None:
    assert choose("L4", "8b").profile.quantization == "none"  # type: ignore[union-attr]
    long_context = choose("L4", "8b", engine={"maxModelLen": 32768})
    assert long_context.profile is not None and long_context.profile.quantization == "int8"


def test_unknown_model_without_size_hints_is_a_spec_error() -> None:
    spec = parse_spec({"model": {"source": "pvc", "pvc": {"claimName": "weights"}}})
    with pytest.raises(SpecError, match="numLayers"):
        model_shape(spec.model)
    hinted = parse_spec(
        {
            "model": {
                "source": "pvc",
                "pvc": {"claimName": "weights"},
                "size": {"parameters": "7B", "numLayers": 32, "numKVHeads": 8, "headDim": 128},
            }
        }
    )
    assert model_shape(hinted.model).num_parameters == 7_000_000_000


@settings(max_examples=60, deadline=None)
@given(
    memory_mib=st.integers(min_value=2_000, max_value=200_000),
    extra_mib=st.integers(min_value=0, max_value=100_000),
    num_parameters=st.integers(min_value=10**8, max_value=2 * 10**11),
    max_model_len=st.sampled_from([512, 4096, 32768]),
)
def test_more_memory_never_means_lower_precision(
    memory_mib: int, extra_mib: int, num_parameters: int, max_model_len: int
) -> None:
    spec = parse_spec(
        {
            "model": {"source": "pvc", "pvc": {"claimName": "w"},
                      "size": {"parameters": num_parameters, "numLayers": 40, "numKVHeads": 8, "headDim": 128}},
            "engine": {"maxModelLen": max_model_len},
        }
    )  # fmt: skip
    shape = model_shape(spec.model)
    order = ("none", "int8", "int4", None)

    def quantization(mib: int) -> str | None:
        [pool] = group_pools([node_info(make_node("n", gpu=("NVIDIA-X", mib, 1)))])
        choice = choose_profile(pool, spec, shape)
        if choice.profile is not None:
            assert choice.profile.needed_bytes <= choice.profile.memory_budget_bytes
            assert choice.profile.kv_cache_bytes >= max_model_len * 2 * 40 * 8 * 128 * 2
        return choice.profile.quantization if choice.profile else None

    assert order.index(quantization(memory_mib + extra_mib)) <= order.index(quantization(memory_mib))


@pytest.mark.parametrize(
    ("hf_id", "stored"),
    [
        ("Qwen/Qwen2.5-7B-Instruct-AWQ", "int4"),
        ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "int4"),
        ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "int8"),
        ("neuralmagic/Meta-Llama-3.1-8B-Instruct-quantized.w4a16", "int4"),
        ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a16", "int8"),
        ("meta-llama/Llama-3.1-8B-Instruct", "none"),
        ("someone/awq-explained-7b", "none"),  # the method must end the name, not start it
    ],
)
def test_checkpoint_quantization_is_detected_from_the_hub_name(hf_id: str, stored: str) -> None:
    spec = parse_spec({"model": {"source": "huggingface", "huggingface": {"id": hf_id}}})
    assert spec.model.checkpoint_quantization == stored
    declared = parse_spec({"model": {"source": "huggingface", "huggingface": {"id": hf_id},
                                     "checkpointQuantization": "none"}})  # fmt: skip
    assert declared.model.checkpoint_quantization == "none"  # an explicit value wins


def test_checkpoint_quantization_must_be_known() -> None:
    with pytest.raises(SpecError, match="checkpointQuantization must be one of auto, none, int8, int4"):
        parse_spec({"model": {"source": "embedded", "checkpointQuantization": "q4_k_m"}})


AWQ_8B = {"source": "huggingface", "huggingface": {"id": "hugging-quants/Llama-3.1-8B-Instruct-AWQ"}}


def choose_model(node: str, model: dict[str, Any], **spec: Any) -> PoolChoice:
    [pool] = group_pools([node_info(make_node("n", **NODES[node]))])
    parsed = parse_spec({"model": model, **spec})
    return choose_profile(pool, parsed, model_shape(parsed.model))


def test_a_prequantized_checkpoint_is_sized_by_its_real_bytes_and_keeps_its_precision() -> None:
    # The base model's shape is found through the pre-quantized name.
    shape = model_shape(parse_spec({"model": AWQ_8B}).model)
    assert shape == model_shape(parse_spec({"model": MODELS["8b"]}).model)
    choice = choose_model("L4", AWQ_8B)
    assert choice.profile is not None and choice.profile.label() == "cuda:bf16/int4"
    assert choice.profile.prequantized and "pre-quantized" in choice.reason
    # Group-128 int4 plus bf16 embeddings: less than the runtime's own group-32 int4 of the same model.
    assert choice.profile.weight_bytes == weight_bytes(shape, "bf16", "int4", prequantized=True)
    assert choice.profile.weight_bytes < weight_bytes(shape, "bf16", "int4")
    # An H200 would run the float 8B unquantized; a pre-quantized checkpoint stays int4 there too.
    assert choose_model("H200", AWQ_8B).profile.label() == "cuda:bf16/int4"  # type: ignore[union-attr]
    # And on CPU: the checkpoint's int4, not a float profile.
    assert choose_model("cpu", AWQ_8B).profile.label() == "cpu:fp32/int4"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "placement",
    [
        {"profile": {"quantization": "int8"}},
        {"profile": {"quantization": "none"}},
        {"forbiddenQuantizations": ["int4"]},
    ],
)
def test_a_prequantized_checkpoint_cannot_be_given_another_precision(placement: dict[str, Any]) -> None:
    choice = choose_model("H100", AWQ_8B, placement=placement)
    assert choice.profile is None and "already int4 (pre-quantized)" in choice.reason


def test_a_prequantized_checkpoint_is_not_split_over_gpus() -> None:
    # 70B in AWQ int4 (~37 GiB) does not fit one L4: the float model would be split, this one cannot be.
    awq_70b = {"source": "huggingface", "huggingface": {"id": "hugging-quants/Llama-3.1-70B-Instruct-AWQ"}}
    choice = choose_model("L4", awq_70b, placement={"maxGpusPerReplica": 8})
    assert choice.profile is None and "does not fit" in choice.reason
    assert choose_model("H100", awq_70b).profile.num_gpus == 1  # type: ignore[union-attr]


def test_an_fp32_checkpoint_counts_four_bytes_a_weight_on_an_fp32_cpu_pool() -> None:
    """The same Llama hinted as an fp32 checkpoint (a fine-tune saved in fp32): its values are no bf16 values, so
    the runtime keeps them in fp32 and 32 GiB no longer hold it unquantized. A bf16 pool is unaffected."""
    fp32_checkpoint = {"model": {**MODELS["8b"], "size": {"checkpointDtype": "fp32"}}}
    [pool] = group_pools([node_info(make_node("n", **NODES["cpu-32"]))])
    parsed = parse_spec(fp32_checkpoint)
    choice = choose_profile(pool, parsed, model_shape(parsed.model))
    assert choice.profile is not None and choice.profile.label() == "cpu:fp32/int8", choice.reason
    bf16_default = choose("cpu-32", "8b").profile
    assert bf16_default is not None and bf16_default.weight_bytes < 0.55 * weight_bytes(
        model_shape(parsed.model), "fp32", "none")
    [bf16_pool] = group_pools([node_info(make_node("n", bf16=True, memory="32Gi"))])
    assert choose_profile(bf16_pool, parsed, model_shape(parsed.model)).profile.label() == "cpu:bf16"
    for bad, message in (({"checkpointDtype": "int8"}, "checkpointDtype must be one of bf16, fp16, fp32"),
                         ({"tieWordEmbeddings": "yes"}, "tieWordEmbeddings must be true or false")):  # fmt: skip
        with pytest.raises(SpecError, match=message):
            parse_spec({"model": {**MODELS["8b"], "size": bad}})
