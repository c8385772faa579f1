"""The pipeline stage split the runtime loads and the operator sizes: balanced by work, the LM head on the last
stage counted in whole layers, and vLLM's VLLM_PP_LAYER_PARTITION override."""

from __future__ import annotations

import pytest

from hpi_contracts.pipeline_split import (
    PP_LAYER_PARTITION_ENV,
    balanced_partition,
    format_partition,
    layer_partition,
    lm_head_layer_cost,
    parse_partition,
    split_disagreement,
)


def test_the_lm_head_costs_its_parameters_in_layers() -> None:
    # SmolLM2-135M: a 49152 x 576 head against 2 x 576 x (9 + 3) x 64 attention + 3 x 576 x 1536 MLP parameters.
    assert lm_head_layer_cost(49152, 576, 884_736 + 2_654_208) == pytest.approx(8.0)
    assert lm_head_layer_cost(49152, 576, 0) == 0.0  # unknown layer size: no head cost


@pytest.mark.parametrize(("num_layers", "num_stages", "head_cost", "expected"), [
    (30, 2, 8.0, (19, 11)),  # 19 | 11 + 8: both stages 19 layers' work (an even 15 + 15 leaves stage 0 at 15 of 23)
    (30, 2, 7.6, (19, 11)),  # the head counts in whole layers, to the nearest
    (30, 2, 0.0, (15, 15)),
    (30, 4, 0.0, (8, 8, 7, 7)),  # the larger shares first
    (30, 3, 8.0, (13, 12, 5)),  # 13 | 12 | 5 + 8
    (80, 2, 1.2, (40, 40)),  # 41 + 39 would save a fifth of a layer's time and cost stage 0 a layer's memory
    (126, 4, 0.66, (32, 32, 31, 31)),
    (126, 5, 0.66, (26, 25, 25, 25, 25)),
    (2, 2, 8.0, (1, 1)),  # every stage keeps at least one layer
    (5, 1, 8.0, (5,)),
])  # fmt: skip
def test_the_split_balances_work_with_the_head_on_the_last_stage(
    num_layers: int, num_stages: int, head_cost: float, expected: tuple[int, ...]
) -> None:
    assert balanced_partition(num_layers, num_stages, head_cost) == expected


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        balanced_partition(2, 3)


def test_vllm_pp_layer_partition_overrides_the_split() -> None:
    assert layer_partition(30, 2, 8.0, {PP_LAYER_PARTITION_ENV: "20,10"}) == (20, 10)
    assert layer_partition(30, 2, 8.0, {PP_LAYER_PARTITION_ENV: " "}) == (19, 11)
    assert layer_partition(30, 1, 8.0, {PP_LAYER_PARTITION_ENV: "20,10"}) == (30,)  # one stage: nothing to split
    assert parse_partition(format_partition((19, 11)), 30, 2) == (19, 11)


@pytest.mark.parametrize(("value", "message"), [
    ("20;10", "must be comma-separated layer counts, got '20;10'"),
    ("20,11", "each of the 2 pipeline stages at least one layer, 30 in all"),
    ("30,0", "each of the 2 pipeline stages at least one layer"),
    ("10,10,10", "each of the 2 pipeline stages"),
])  # fmt: skip
def test_a_bad_partition_is_a_clear_error(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layer_partition(30, 2, 0.0, {PP_LAYER_PARTITION_ENV: value})


def test_hosts_that_split_differently_are_named() -> None:
    assert split_disagreement([(0, 19), (19, 30)], 30) is None
    # The leader split 19 + 11, the worker host was given VLLM_PP_LAYER_PARTITION=15,15: layers 15-18 twice.
    assert "stage 1 holds layers 15-29, but the stage before it ends at layer 18" in split_disagreement(
        [(0, 19), (15, 30)], 30)
    assert "the last stage ends at layer 24 of 30" in split_disagreement([(0, 15), (15, 25)], 30)
