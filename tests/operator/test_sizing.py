"""Memory arithmetic for tensor parallelism: which GPU counts split a model, and what KV costs per replica."""

from __future__ import annotations

import pytest

from hpi_operator.sizing import (
    KNOWN_SHAPES,
    ModelShape,
    kv_bytes_per_token,
    max_kv_heads_per_rank,
    model_shape,
    splits_heads,
    why_heads_do_not_split,
)
from hpi_operator.spec import SpecError, parse_spec

# (query heads, KV heads): MHA, GQA with even and odd groups, MQA, and the known models' shapes.
HEAD_SHAPES = [(9, 3), (15, 5), (32, 32), (32, 8), (64, 8), (28, 4), (3, 1), (4, 1), (2, 2), (6, 2), (12, 3), (40, 8)]


def shape(num_heads: int, num_kv_heads: int) -> ModelShape:
    return ModelShape(10**9, 4, num_kv_heads, 64, num_heads=num_heads)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_SHAPES)
def test_splits_heads_agrees_with_the_runtime(num_heads: int, num_kv_heads: int) -> None:
    parallel = pytest.importorskip("hpi_runtime.model.parallel")  # the runtime needs torch; the operator not

    def runtime_splits(tp_size: int) -> bool:
        try:
            for rank in range(tp_size):
                parallel.split_heads(num_heads, num_kv_heads, tp_size, rank)
        except ValueError:
            return False
        return True

    for tp_size in range(1, 17):
        assert splits_heads(shape(num_heads, num_kv_heads), tp_size) == runtime_splits(tp_size), tp_size


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_SHAPES)
def test_fullest_rank_holds_as_many_kv_heads_as_the_runtime_gives_it(num_heads: int, num_kv_heads: int) -> None:
    parallel = pytest.importorskip("hpi_runtime.model.parallel")
    model = shape(num_heads, num_kv_heads)
    for tp_size in (n for n in range(1, 17) if splits_heads(model, n)):
        sizes = [parallel.split_heads(num_heads, num_kv_heads, tp_size, r).kv.size for r in range(tp_size)]
        assert max_kv_heads_per_rank(model, tp_size) == max(sizes), tp_size


def test_without_num_heads_only_counts_up_to_the_kv_heads_are_offered() -> None:
    unknown = ModelShape(10**9, 4, 2, 64)
    assert [n for n in (1, 2, 4, 8) if splits_heads(unknown, n)] == [1, 2]
    assert "numHeads is unknown" in why_heads_do_not_split(unknown, 8)
    assert [n for n in (1, 2, 4, 8) if splits_heads(shape(8, 2), n)] == [1, 2, 4, 8]


def test_why_heads_do_not_split_lists_the_counts_that_do() -> None:
    assert why_heads_do_not_split(shape(3, 1), 8) == "3 attention heads over 1 KV head split only over 1 or 3 GPUs"
    assert why_heads_do_not_split(shape(9, 3), 8).endswith("split only over 1, 2 or 3 GPUs")


def test_uneven_and_replicated_kv_heads_cost_the_fullest_ranks_share_on_every_rank() -> None:
    even, uneven, replicated = shape(32, 8), shape(9, 3), shape(4, 1)
    assert kv_bytes_per_token(even, "bf16", 2) == kv_bytes_per_token(even, "bf16")
    # 3 KV heads over 2 ranks: rank 0 holds 2, so both ranks allocate blocks of 2 heads.
    assert kv_bytes_per_token(uneven, "bf16", 2) == kv_bytes_per_token(uneven, "bf16") * 4 // 3
    # 1 KV head over 4 ranks: each rank keeps a copy.
    assert kv_bytes_per_token(replicated, "bf16", 4) == kv_bytes_per_token(replicated, "bf16") * 4
    assert kv_bytes_per_token(uneven, "bf16", 0) == kv_bytes_per_token(uneven, "bf16")  # CPU: no GPUs


def test_known_shapes_carry_query_heads_that_their_kv_heads_divide() -> None:
    for name, known in KNOWN_SHAPES.items():
        assert known.num_heads > 0 and known.num_heads % known.num_kv_heads == 0, name
        assert known.num_heads * known.head_dim == known.hidden_size, name
    assert KNOWN_SHAPES["llama-3.1-70b-instruct"].num_heads == 64
    assert KNOWN_SHAPES["smollm2-135m-instruct"].num_heads == 9


def test_num_heads_hint_reaches_the_shape_and_overrides_the_known_value() -> None:
    size = {"parameters": "1B", "numLayers": 4, "numKVHeads": 1, "headDim": 64}
    hinted = parse_spec({"model": {"source": "pvc", "pvc": {"claimName": "w"}, "size": {**size, "numHeads": 3}}})
    assert model_shape(hinted.model).num_heads == 3
    unhinted = parse_spec({"model": {"source": "pvc", "pvc": {"claimName": "w"}, "size": size}})
    assert model_shape(unhinted.model).num_heads == 0
    llama = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}}
    assert model_shape(parse_spec({"model": llama}).model).num_heads == 32
    assert model_shape(parse_spec({"model": {**llama, "size": {"numHeads": 16}}}).model).num_heads == 16


def test_a_kv_head_hint_that_does_not_divide_the_known_heads_is_a_spec_error() -> None:
    llama = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}}
    with pytest.raises(SpecError, match="numKVHeads must divide numHeads"):
        model_shape(parse_spec({"model": {**llama, "size": {"numKVHeads": 3}}}).model)
