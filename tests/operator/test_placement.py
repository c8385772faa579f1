"""Pool ranking and replica spreading."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpi_operator.nodes import group_pools, node_info
from hpi_operator.placement import Slot, eligible_choices, rank_choices, spread_replicas
from hpi_operator.profiles import choose_profile
from hpi_operator.sizing import model_shape
from hpi_operator.spec import parse_spec
from hpi_testing.kube_emulator import H100, L4, T4, make_node


def test_fills_slots_in_order_up_to_capacity() -> None:
    slots = [Slot("a", 2), Slot("b", 3), Slot("c", 5)]
    assert spread_replicas(4, slots) == {"a": 2, "b": 2, "c": 0}
    assert spread_replicas(0, slots) == {"a": 0, "b": 0, "c": 0}


def test_excess_goes_to_the_first_slot() -> None:
    assert spread_replicas(7, [Slot("a", 2), Slot("b", 1)]) == {"a": 6, "b": 1}


def test_no_slots_and_negative_replicas() -> None:
    assert spread_replicas(3, []) == {}
    with pytest.raises(ValueError):
        spread_replicas(-1, [Slot("a", 1)])


@given(
    st.integers(min_value=0, max_value=200),
    st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=6),
)
def test_spread_keeps_the_total_and_respects_capacity(replicas: int, capacities: list[int]) -> None:
    slots = [Slot(f"p{i}", c) for i, c in enumerate(capacities)]
    counts = spread_replicas(replicas, slots)
    assert sum(counts.values()) == replicas
    total = sum(capacities)
    for slot in slots[1:]:
        assert counts[slot.pool_name] <= slot.capacity
    if replicas <= total:
        assert counts[slots[0].pool_name] <= slots[0].capacity


def _choices(spec: dict):
    nodes = [node_info(n) for n in (make_node("h", gpu=H100), make_node("l", gpu=L4), make_node("t", gpu=T4),
                                    make_node("c", bf16=True))]  # fmt: skip
    parsed = parse_spec(spec)
    return [choose_profile(p, parsed, model_shape(parsed.model)) for p in group_pools(nodes)], parsed


def test_rank_prefers_gpu_then_precision_then_memory() -> None:
    model = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}}
    choices, _ = _choices({"model": model})
    ranked = rank_choices(eligible_choices(choices, ()), ())
    assert [c.pool.name for c in ranked] == ["gpu-h100-80gb-hbm3", "gpu-l4", "gpu-t4", "cpu-amd64-bf16"]


def test_preferred_pools_come_first_and_allowed_pools_filter() -> None:
    choices, _ = _choices({})
    ranked = rank_choices(eligible_choices(choices, ("gpu-l4", "cpu-amd64-bf16")), ("cpu-amd64-bf16",))
    assert [c.pool.name for c in ranked] == ["cpu-amd64-bf16", "gpu-l4"]
