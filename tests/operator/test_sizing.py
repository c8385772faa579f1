"""Memory arithmetic for tensor parallelism: which GPU counts split a model, and what KV costs per replica."""

from __future__ import annotations

import math

import pytest

from hpi_operator.sizing import (
    KNOWN_SHAPES,
    ModelShape,
    active_parameters,
    kv_bytes_per_token,
    max_kv_heads_per_rank,
    model_shape,
    splits_heads,
    weight_bytes,
    why_heads_do_not_split,
)
from hpi_operator.spec import SpecError, parse_spec

# (query heads, KV heads): MHA, GQA with even and odd groups, MQA, and the known models' shapes.
HEAD_SHAPES = [(9, 3), (15, 5), (32, 32), (32, 8), (64, 8), (28, 4), (3, 1), (4, 1), (2, 2), (6, 2), (12, 3), (40, 8)]


def shape(num_heads: int, num_kv_heads: int) -> ModelShape:
    return ModelShape(10**9, 4, num_kv_heads, 64, num_heads=num_heads)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEAD_SHAPES)
def test_splits_heads_agrees_with_the_runtime(num_heads: int, num_kv_heads: int) -> None:
    parallel = pytest.importorskip("hpi_runtime.models.parallel")  # the runtime needs torch; the operator not

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
    parallel = pytest.importorskip("hpi_runtime.models.parallel")
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
        if not name.startswith("qwen3"):  # Qwen3 fixes head_dim at 128 whatever the hidden size
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


def _moe_parameter_counts(c: dict) -> tuple[int, int]:
    """(all, active) parameters of a Mixtral / Qwen-MoE config.json (untied embeddings), counted tensor by
    tensor as the checkpoint stores them."""
    hidden, head_dim = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    attention += (q + 2 * kv) * c.get("qkv_bias", False) + 2 * head_dim * c.get("qk_norm", False)
    expert = 3 * hidden * c["moe_intermediate_size"]
    shared = 3 * hidden * c.get("shared_expert_intermediate_size", 0) + hidden * bool(
        c.get("shared_expert_intermediate_size")
    )
    always = attention + shared + c["num_experts"] * hidden + 2 * hidden  # + router + the two norms
    embeddings = 2 * c["vocab_size"] * hidden + hidden  # embedding, LM head, final norm
    layers = c["num_hidden_layers"]
    total = layers * (always + c["num_experts"] * expert) + embeddings
    active = layers * (always + c["num_experts_per_tok"] * expert) + embeddings
    return total, active


MOE_CONFIGS = {  # the fields of each model's config.json that set its size
    "mixtral-8x7b-instruct-v0.1": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                       moe_intermediate_size=14336, num_experts=8, num_experts_per_tok=2,
                                       num_hidden_layers=32, vocab_size=32000),
    "qwen1.5-moe-a2.7b": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, qkv_bias=True,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
                              num_experts_per_tok=4, num_hidden_layers=24, vocab_size=151936),
    "qwen2-57b-a14b-instruct": dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, qkv_bias=True,
                                    moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
                                    num_experts=64, num_experts_per_tok=8, num_hidden_layers=28, vocab_size=151936),
    "qwen3-30b-a3b": dict(hidden_size=2048, head_dim=128, num_attention_heads=32, num_key_value_heads=4,
                          qk_norm=True, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          num_hidden_layers=48, vocab_size=151936),
    "qwen3-235b-a22b": dict(hidden_size=4096, head_dim=128, num_attention_heads=64, num_key_value_heads=4,
                            qk_norm=True, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                            num_hidden_layers=94, vocab_size=151936),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_moe_shapes_count_every_expert_and_report_the_routed_share_as_active(name: str) -> None:
    total, active = _moe_parameter_counts(MOE_CONFIGS[name])
    known = KNOWN_SHAPES[name]
    assert (known.num_parameters, active_parameters(known)) == (total, active)
    assert known.is_moe and known.num_layers == MOE_CONFIGS[name]["num_hidden_layers"]


def test_moe_memory_counts_all_experts_and_compute_the_active_ones() -> None:
    mixtral = model_shape(
        parse_spec(
            {"model": {"source": "huggingface", "huggingface": {"id": "mistralai/Mixtral-8x7B-Instruct-v0.1"}}}
        ).model
    )
    assert mixtral.num_parameters == 46_702_792_704 and active_parameters(mixtral) == 12_879_925_248
    assert weight_bytes(mixtral, "bf16", "none") == 2 * 46_702_792_704  # every expert is resident
    qwen3 = model_shape(
        parse_spec({"model": {"source": "huggingface", "huggingface": {"id": "Qwen/Qwen3-30B-A3B"}}}).model
    )
    assert round(active_parameters(qwen3) / 1e9, 1) == 3.4 and round(qwen3.num_parameters / 1e9, 1) == 30.5
    dense = KNOWN_SHAPES["llama-3.1-8b-instruct"]
    assert not dense.is_moe and active_parameters(dense) == dense.num_parameters


def test_a_vision_tower_stays_unquantized_and_its_encoder_cache_is_counted() -> None:
    """Qwen2.5-VL-7B-shaped hints: 8.29B parameters of which 0.68B are the vision tower and projector."""
    from hpi_operator.nodes import group_pools, node_info
    from hpi_operator.profiles import choose_profile
    from hpi_operator.sizing import encoder_cache_bytes
    from hpi_testing.kube_emulator import make_node

    size = {"parameters": "8.29B", "numLayers": 28, "numKVHeads": 4, "numHeads": 28, "headDim": 128,
            "hiddenSize": 3584, "vocabSize": 152064}  # fmt: skip
    text = parse_spec({"model": {"source": "pvc", "pvc": {"claimName": "w"}, "size": size}})
    vlm = parse_spec({"model": {"source": "pvc", "pvc": {"claimName": "w"},
                                "size": {**size, "visionParameters": "0.68B"}}})  # fmt: skip
    text_shape, vlm_shape = model_shape(text.model), model_shape(vlm.model)
    assert weight_bytes(vlm_shape, "bf16", "none") == weight_bytes(text_shape, "bf16", "none")
    # int4 leaves the 0.68B vision parameters in bf16: 2 bytes each instead of int4's 0.625.
    extra = weight_bytes(vlm_shape, "bf16", "int4") - weight_bytes(text_shape, "bf16", "int4")
    assert extra == pytest.approx(0.68e9 * (2 - 0.625), rel=1e-3)
    assert encoder_cache_bytes(text_shape, "bf16", 2048) == 0
    assert encoder_cache_bytes(vlm_shape, "bf16", 2048) == 2048 * 3584 * 2
    [pool] = group_pools([node_info(make_node("cpu", memory="64Gi"))])
    text_profile, vlm_profile = (choose_profile(pool, s, model_shape(s.model)).profile for s in (text, vlm))
    assert text_profile is not None and vlm_profile is not None
    assert vlm_profile.overhead_bytes - text_profile.overhead_bytes == 2048 * 3584 * 4  # fp32 on this CPU pool
    with pytest.raises(SpecError, match="visionParameters counts part of"):
        parse_spec({"model": {"source": "pvc", "pvc": {"claimName": "w"},
                              "size": {**size, "visionParameters": "9B"}}})  # fmt: skip


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("checkpoint_dtype", ["bfloat16", "float32"])
def test_weight_bytes_match_what_the_runtime_holds(tmp_path, tied: bool, checkpoint_dtype: str) -> None:
    """The operator's weight arithmetic for an fp32 CPU replica against the runtime's own count of the parameters
    it holds after loading a tiny llama: unquantized, the linears of a bf16 checkpoint live in bf16 panels (half of
    fp32); an untied LM head stays in float when the rest is int8/int4; int4 keeps q/k/v at int8. The operator
    may count more (a tied embedding packed with the head is counted in fp32), and less only by the per-channel
    int8 scales and the norms (under 2% at this hidden size of 256, a tenth of that from 2048 up)."""
    pytest.importorskip("hpi_runtime")  # the runtime needs torch; the operator not
    from safetensors import safe_open

    from hpi_operator.sizing import linear_dtype
    from hpi_runtime.llm import LLM
    from hpi_testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path, "llama", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2,
                                 intermediate_size=512, tie_word_embeddings=tied, dtype=checkpoint_dtype)  # fmt: skip
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        parameters = sum(math.prod(checkpoint.get_slice(k).get_shape()) for k in checkpoint.keys())
    size = {"parameters": parameters, "numLayers": 4, "numKVHeads": 2, "numHeads": 4, "headDim": 64,
            "hiddenSize": 256, "vocabSize": 384, "tieWordEmbeddings": tied,
            "checkpointDtype": {"bfloat16": "bf16", "float32": "fp32"}[checkpoint_dtype]}  # fmt: skip
    shape = model_shape(parse_spec({"model": {"source": "pvc", "pvc": {"claimName": "w"}, "size": size}}).model)
    linears = linear_dtype(shape, "fp32", "cpu")
    assert linears == ("bf16" if checkpoint_dtype == "bfloat16" else "fp32")
    for quantization in ("none", "int8", "int4"):
        # Eager: compiling the step changes no weight and costs ~5 s a start on 2 cores.
        with LLM(model_dir, dtype="float32", device="cpu", quantization=quantization, enforce_eager=True) as llm:
            held = llm.bundle.footprint.weight_bytes
        counted = weight_bytes(shape, "fp32", quantization, linears=linears)
        assert 0.98 * held <= counted <= 1.1 * held, (quantization, counted, held)


def test_the_int4_policy_counted_is_the_runtimes_default() -> None:
    """sizing counts the linears the runtime's default int4 policy keeps at int8 (every layer's q/k/v); a change
    to that policy must change the arithmetic too."""
    policy = pytest.importorskip("hpi_runtime.quantization.policy")  # the runtime needs torch; the operator not
    from hpi_operator.sizing import INT4_POLICY, INT4_QKV_AT_INT8

    assert INT4_POLICY == policy.DEFAULT_INT4_POLICY
    # every layer's merged q/k/v at int8 (what int8_under_int4 counts), or nothing
    assert policy.INT4_POLICIES[INT4_POLICY] == ({"qkv_proj": "all"} if INT4_QKV_AT_INT8 else {})
