"""Profile choice over node shapes x model sizes, pins and forbids, and the no-fit outcome."""

from __future__ import annotations

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
    "cpu-bf16": dict(bf16=True, memory="64Gi"),
    "cpu": dict(memory="64Gi"),
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
    ("A100-80", "70b", 1, "cuda:bf16/int4"),
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
    ("cpu", "135m", 1, "cpu:fp32"),
    ("cpu", "8b", 1, "cpu:fp32"),
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


def test_no_fit_reason_names_the_smallest_need() -> None:
    choice = choose("L4", "70b")
    assert choice.profile is None
    assert "int4" in choice.reason and "GiB" in choice.reason


def test_quantized_weights_shrink_as_expected() -> None:
    shape = model_shape(parse_spec({"model": MODELS["8b"]}).model)
    bf16, int8, int4 = (weight_bytes(shape, "bf16", q) for q in ("none", "int8", "int4"))
    assert 14.9 * GIB < bf16 < 15.0 * GIB
    assert int8 < 0.6 * bf16 and int4 < 0.4 * bf16


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
        ({"forbiddenQuantizations": ["int4"]}, "A100-40", None),
        ({"forbiddenQuantizations": ["none"]}, "H100", "cuda:bf16/int8"),
    ],
)
def test_pins_and_forbids(placement: dict[str, Any], node: str, expected: str | None) -> None:
    model = "70b" if node == "A100-40" else "8b"
    choice = choose(node, model, placement=placement)
    assert (choice.profile.label() if choice.profile else None) == expected, choice.reason


def test_forbidding_int4_leaves_70b_on_one_h100_without_a_profile() -> None:
    choice = choose("H100", "70b", placement={"forbiddenQuantizations": ["int4"]})
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
