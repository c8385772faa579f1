"""Tensor-parallel splits (pure) and shard loading: every rank's slices, put back together, are the model.

The multi-process runs (gloo, real worker processes) are in tests/runtime/worker/test_tensor_parallel.py.
Loading needs no process group (no collective runs while loading), so the ranks' shards are built here
side by side in one process and compared with the unsharded model.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hpi_runtime.attention.torch_backend import TorchAttentionBackend
from hpi_runtime.engine_factory import check_tensor_parallel
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.loader import load_model
from hpi_runtime.models.parallel import TensorParallel, balanced_span, split_heads
from hpi_runtime.quantization.quantize import QuantizationConfig, check_model_supported


@given(total=st.integers(1, 5000), parts=st.integers(1, 16), unit=st.sampled_from([1, 16, 32]))
def test_balanced_spans_tile_the_dimension(total: int, parts: int, unit: int) -> None:
    if -(-total // unit) < parts:
        with pytest.raises(ValueError, match="cannot be split"):
            balanced_span(total, parts, 0, unit)
        return
    spans = [balanced_span(total, parts, i, unit) for i in range(parts)]
    assert spans[0].start == 0 and spans[-1].stop == total
    assert all(a.stop == b.start for a, b in itertools.pairwise(spans))
    assert all(s.start % unit == 0 and s.size > 0 for s in spans)
    num_units = [-(-s.size // unit) for s in spans]  # only the last span may end in a short unit
    assert max(num_units) - min(num_units) <= 1 and num_units == sorted(num_units, reverse=True)


@given(st.data())
def test_head_splits_keep_every_query_head_with_its_kv_head(data: st.DataObject) -> None:
    num_kv_heads = data.draw(st.integers(1, 12))
    num_heads = num_kv_heads * data.draw(st.integers(1, 8))
    tp_size = data.draw(st.integers(1, 2 * num_heads))
    group = num_heads // num_kv_heads
    try:
        splits = [split_heads(num_heads, num_kv_heads, tp_size, r) for r in range(tp_size)]
    except ValueError as e:
        assert tp_size > num_kv_heads and "sizes that work for this model" in str(e)
        return
    covered = sorted(h for s in splits for h in range(s.q.start, s.q.stop))
    assert covered == list(range(num_heads))  # each query head on exactly one rank
    for s in splits:
        # GQA stays uniform on each rank: local query head i reads local KV head i // local group size.
        assert s.q.size % s.kv.size == 0
        local_group = s.q.size // s.kv.size
        for i, h in enumerate(range(s.q.start, s.q.stop)):
            assert h // group == s.kv.start + i // local_group


def test_uneven_and_replicated_head_splits() -> None:
    # SmolLM2-135M: 9 query heads over 3 KV heads. tp 2: whole groups, 6 + 3 heads.
    assert [(s.q.size, s.kv.size) for s in (split_heads(9, 3, 2, r) for r in range(2))] == [(6, 2), (3, 1)]
    # More ranks than KV heads: each KV head replicated on the ranks sharing its query heads.
    assert [(s.q.start, s.kv.start) for s in (split_heads(8, 2, 4, r) for r in range(4))] == [
        (0, 0), (2, 0), (4, 1), (6, 1)]  # fmt: skip
    with pytest.raises(ValueError, match=r"tensor_parallel_size 6 .* sizes that work for this model: \[1, 2, 3, 9\]"):
        split_heads(9, 3, 6, 0)


def test_unsplittable_sizes_fail_before_loading(tiny_model_factory) -> None:
    config = load_model_config(tiny_model_factory("llama", num_heads=4, num_kv_heads=2))
    with pytest.raises(ValueError, match="tensor_parallel_size 3 cannot split 4 attention heads over 2 KV heads"):
        check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="at least 1"):
        check_tensor_parallel(config, 0)
    check_tensor_parallel(config, 4)  # 2 ranks per KV head, one query head each


def test_int4_group_size_is_checked_per_rank(tiny_model_factory) -> None:
    # hidden 64 (K of qkv/gate_up), 4 heads x 16: o_proj K per rank at tp 2 = 32, MLP 128 -> 64 per rank.
    config = load_model_config(tiny_model_factory("llama", num_heads=4, num_kv_heads=2, intermediate_size=128))
    check_model_supported(config, QuantizationConfig("int4", 32), tp_size=2)
    with pytest.raises(ValueError, match=r"o_proj \(heads x head_dim, rank 0\) K = 32"):
        check_model_supported(config, QuantizationConfig("int4", 64), tp_size=2)
    check_model_supported(config, QuantizationConfig("int4", 64), tp_size=1)


def _shards(model_dir: Path, tp_size: int) -> list[dict[str, torch.Tensor]]:
    config = load_model_config(model_dir)
    backend = TorchAttentionBackend()
    return [
        dict(load_model(config, torch.float32, torch.device("cpu"), backend, TensorParallel(r, tp_size)).state_dict())
        for r in range(tp_size)
    ]


@pytest.mark.parametrize(
    ("arch", "overrides", "tp_size"),
    [
        ("llama", dict(num_heads=6, num_kv_heads=3, hidden_size=96, intermediate_size=160, mlp_bias=True), 2),  # uneven
        ("qwen2", dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=False), 2),  # qkv biases, own head
        ("llama", dict(num_heads=8, num_kv_heads=2, hidden_size=64), 4),  # KV heads replicated
        ("phi3", dict(num_heads=6, num_kv_heads=3, hidden_size=96, intermediate_size=160), 2),  # fused qkv, gate_up
        ("qwen3", dict(num_heads=8, num_kv_heads=2, tie_word_embeddings=False), 4),  # q/k norms replicated
        ("gemma3", dict(sliding_window=8, num_layers=2), 2),  # four norms a layer, q/k norms
    ],
)
def test_shards_reassemble_the_unsharded_weights(tiny_model_factory, arch, overrides, tp_size) -> None:
    model_dir = tiny_model_factory(arch, **overrides)
    [full] = _shards(model_dir, 1)
    shards = _shards(model_dir, tp_size)
    config = load_model_config(model_dir)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name, whole in full.items():
        parts = [s[name] for s in shards]
        if "qkv_proj" in name:
            splits = [split_heads(config.num_heads, config.num_kv_heads, tp_size, r) for r in range(tp_size)]
            d = config.head_dim
            for part, split in zip(parts, splits, strict=True):
                nq, nkv = split.q.size * d, split.kv.size * d
                assert torch.equal(part[:nq], whole[split.q.start * d : split.q.stop * d])
                assert torch.equal(part[nq : nq + nkv], whole[q + split.kv.start * d : q + split.kv.stop * d])
                assert torch.equal(part[nq + nkv :], whole[q + kv + split.kv.start * d : q + kv + split.kv.stop * d])
        elif "gate_up_proj" in name:
            half = whole.shape[0] // 2
            gates = torch.cat([p[: p.shape[0] // 2] for p in parts])
            ups = torch.cat([p[p.shape[0] // 2 :] for p in parts])
            assert torch.equal(gates, whole[:half]) and torch.equal(ups, whole[half:])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), whole)
        elif name.endswith(("o_proj.bias", "down_proj.bias")):  # added once: rank 0 holds it
            assert torch.equal(parts[0], whole) and all(not p.any() for p in parts[1:])
        elif "embed_tokens" in name or "lm_head" in name:
            assert torch.equal(torch.cat(parts), whole)
        else:  # norms: replicated
            assert all(torch.equal(p, whole) for p in parts), name
