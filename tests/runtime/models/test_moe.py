"""Mixture-of-Experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on tiny random models.

Each family is built with transformers' own config class and saved with save_pretrained (per-expert tensor
names, as Hub checkpoints have them); the runtime loads it and must match transformers' logits at every step
of paged, batched generation (chunked prefill, prefix-cache hits, preemption) and its greedy `generate`.
Also: routing normalisation, the grouped expert path against the per-token reference, config reading, tensor-
parallel expert shards, and int8/int4 experts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hpi_kernels.reference import fused_experts_ref
from hpi_runtime.attention.torch_backend import TorchAttentionBackend
from hpi_runtime.llm import LLM
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.loader import load_model
from hpi_runtime.models.moe import FusedExperts, QuantizedExperts, SparseMoeBlock, moe_experts, select_experts
from hpi_runtime.models.parallel import TensorParallel, mlp_span
from hpi_runtime.quantization.quantize import (
    QuantizationConfig,
    check_model_supported,
    quantize_model,
    resolve_quantization,
)
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.model_runner import KVCacheSpec, ModelRunner, allocate_kv_caches

from .conftest import HandScheduler
from .test_parity import _hf_model, _prompts, _run_and_compare

# Tiny variants: 2 layers, hidden 64; experts' intermediate 32 or 64 (multiples of the int4 group, 32).
FAMILIES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
    # layer 1 dense (mlp_only_layers), a shared expert, top-k weights not renormalised, qkv bias
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32),
    ),
}


@pytest.fixture(scope="module")
def moe_model_dirs(tiny_model_factory) -> dict[str, Path]:
    return {name: tiny_model_factory(arch, **overrides) for name, (arch, overrides) in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_paged_batches_match_transformers_logits(family, moe_model_dirs, make_runner) -> None:
    model_dir = moe_model_dirs[family]
    runner, hf_model = make_runner(model_dir, num_blocks=48), _hf_model(model_dir)
    vocab_size = runner.model.config.vocab_size
    shared, tail_a, tail_b = _prompts(vocab_size, [24, 5, 9], seed=2)
    scheduler = HandScheduler(num_blocks=48, block_size=8, chunk_size=7)  # chunked prefill
    scheduler.add("a", shared + tail_a)
    scheduler.add("other", _prompts(vocab_size, [30], seed=3)[0])
    scheduler.add("short", _prompts(vocab_size, [1], seed=5)[0])

    def prefix_hit(s: HandScheduler) -> None:
        s.add("b", shared + tail_b, shared_prefix_of="a", num_shared_blocks=3)

    def preempt_other(s: HandScheduler) -> None:
        s.preempt("other")  # recomputed from scratch into reused blocks

    events = {5: prefix_hit, 7: preempt_other}
    checked = _run_and_compare(runner, hf_model, scheduler, num_steps=14, events=events)
    assert checked >= 25


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_greedy_tokens_equal_transformers_generate(family, moe_model_dirs) -> None:
    """The real engine (scheduler, block pool with prefix caching, preemption; compiled step for one family)."""
    model_dir = moe_model_dirs[family]
    hf_model = _hf_model(model_dir)
    block_size, num_new = 8, 12
    config = load_model_config(model_dir)
    kv_bytes = config.kv_bytes_per_token(4) * block_size * 12  # 12 blocks: not all four requests at once
    llm = LLM(
        model_dir,
        dtype="float32",
        block_size=block_size,
        max_model_len=64,
        max_num_batched_tokens=32,
        kv_cache_memory_bytes=kv_bytes,
        enforce_eager=family != "qwen2_moe",  # one family through torch.compile is enough (slow on 2 cores)
    )
    vocab_size = config.vocab_size
    prompts = _prompts(vocab_size, [30, 17, 25, 9], seed=7)
    # Shares 3 full blocks with the first prompt; run alone twice, the second run finds them cached at least.
    prompts += [prompts[0][:24] + tail for tail in _prompts(vocab_size, [4, 6], seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    outputs = llm.generate(prompts[:4], params) + llm.generate(prompts[4:5], params) + llm.generate(prompts[5:], params)
    assert llm.engine.core.executor.runner.is_compiled == (family == "qwen2_moe")
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 24
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False
            )[0, len(prompt) :]
        assert list(output.output_token_ids) == expected.tolist()
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_cuda_fused_kernel_generates_transformers_tokens(family, moe_model_dirs) -> None:
    """On CUDA the float experts run through hpi_kernels' fused-MoE Triton kernel, int8/int4 ones through the
    grouped loop over the Triton quantized matmuls."""
    model_dir = moe_model_dirs[family]
    hf_model = _hf_model(model_dir)
    prompts = _prompts(load_model_config(model_dir).vocab_size, [19, 6, 33], seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(model_dir, device="cuda", dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 22) as llm:
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert list(output.output_token_ids) == expected[0, len(prompt) :].tolist()
    for method in ("int8", "int4"):
        with LLM(model_dir, device="cuda", dtype="bfloat16", quantization=method, max_model_len=64,
                 kv_cache_memory_bytes=1 << 22) as llm:  # fmt: skip
            assert all(len(o.output_token_ids) == 10 for o in llm.generate(prompts, params))


def test_bfloat16_tracks_float32(moe_model_dirs) -> None:
    """bf16 weights and activations (the experts' grouped matmuls in bf16, routing in fp32) stay near fp32."""
    model_dir = moe_model_dirs["qwen2_moe"]
    prompt = _prompts(load_model_config(model_dir).vocab_size, [20], seed=6)[0]
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        config, backend = load_model_config(model_dir), TorchAttentionBackend(dtype)
        model = load_model(config, dtype, torch.device("cpu"), backend)
        allocate_kv_caches(model, KVCacheSpec(8, 8, dtype), torch.device("cpu"))
        scheduler = HandScheduler(num_blocks=8, block_size=8)
        scheduler.add("r", prompt)
        logits[dtype] = ModelRunner(model, backend, 8, config.eos_token_ids, 0).forward(scheduler.schedule()).logits[0]
    error = (logits[torch.bfloat16] - logits[torch.float32]).norm() / logits[torch.float32].norm()
    assert error < 0.05, error


def test_routing_normalisation() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = select_experts(logits, top_k=2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])  # Qwen without norm_topk_prob: softmax over all experts
    weights, _ = select_experts(logits, top_k=2, renormalize=True)
    torch.testing.assert_close(weights, logits[:, :2].softmax(-1))  # Mixtral: softmax over the chosen k


@pytest.mark.parametrize("num_tokens", [1, 13])
def test_grouped_experts_match_the_per_token_reference(num_tokens) -> None:
    generator = torch.Generator().manual_seed(0)
    num_experts, hidden, intermediate = 6, 32, 24
    x = torch.randn(num_tokens, hidden, generator=generator)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / 4
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) / 4
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=generator), 2, True)
    out = moe_experts(x, weights, ids, [w13], [w2], "none", 0)
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    compiled = torch.compile(lambda *a: torch.ops.hpi.moe_experts(*a), fullgraph=True)  # opaque to Dynamo
    torch.testing.assert_close(compiled(x, weights, ids, [w13], [w2], "none", 0), out)


def test_config_reads_each_family(moe_model_dirs) -> None:
    mixtral = load_model_config(moe_model_dirs["mixtral"])
    assert (mixtral.moe.num_experts, mixtral.moe.expert_intermediate_size, mixtral.moe.norm_topk_prob) == (4, 64, True)
    qwen2 = load_model_config(moe_model_dirs["qwen2_moe"])
    assert qwen2.qkv_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    assert qwen2.moe.dense_layer_ids == frozenset({1}) and qwen2.moe.shared_expert_intermediate_size == 64
    assert not qwen2.moe.norm_topk_prob
    qwen3 = load_model_config(moe_model_dirs["qwen3_moe"])  # transformers 5 writes num_local_experts here
    assert qwen3.qk_norm and not qwen3.qkv_bias
    assert (qwen3.moe.num_experts, qwen3.moe.num_experts_per_tok, qwen3.moe.shared_expert_intermediate_size) == (
        8,
        3,
        0,
    )
    assert qwen3.moe.dense_layer_ids == frozenset()


@pytest.mark.parametrize(
    ("family", "expert_tensor"),
    [("mixtral", "block_sparse_moe.experts.3.w2.weight"), ("qwen2_moe", "mlp.experts.7.down_proj.weight")],
)
def test_checkpoints_name_experts_one_by_one_and_every_expert_is_loaded(
    family, expert_tensor, moe_model_dirs, tmp_path
):
    """save_pretrained writes the Hub's per-expert names (transformers 5 fuses experts in memory only); a
    checkpoint that lacks one expert's tensor fails to load instead of running with garbage."""
    from safetensors.torch import load_file, save_file

    source = moe_model_dirs[family]
    tensors = load_file(source / "model.safetensors")
    name = f"model.layers.0.{expert_tensor}"
    assert name in tensors
    model_dir = tmp_path / family
    shutil.copytree(source, model_dir)
    del tensors[name]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="checkpoint is missing 1 tensors"):
        _load(model_dir)


def test_sparse_step_and_mlp_only_layers_pick_dense_layers(tiny_model_factory, make_runner) -> None:
    model_dir = tiny_model_factory(
        "qwen2_moe", num_layers=4, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    model = make_runner(model_dir).model
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [False, True, False, False]  # (i + 1) % 2 == 0 -> layers 1, 3; layer 3 is mlp-only


def _load(model_dir: Path, tp: TensorParallel = TensorParallel()):
    config = load_model_config(model_dir)
    return load_model(config, torch.float32, torch.device("cpu"), TorchAttentionBackend(), tp)


def test_tensor_parallel_splits_each_experts_intermediate(tiny_model_factory) -> None:
    """At tp 2 each rank holds its span of every expert's intermediate dimension (gate, up rows; down columns)
    and a replica of the router; the spans put back together are the unsharded experts."""
    model_dir = tiny_model_factory("qwen2_moe", **{**FAMILIES["qwen2_moe"][1], "moe_intermediate_size": 64})
    full = dict(_load(model_dir).state_dict())
    shards = [dict(_load(model_dir, TensorParallel(r, 2)).state_dict()) for r in range(2)]
    spans = [mlp_span(64, 2, r) for r in range(2)]
    for name, whole in full.items():
        parts = [s[name] for s in shards]
        if name.endswith("experts.w13.weight"):  # [E, 2 * I, H]: gate rows then up rows, per rank
            half = whole.shape[1] // 2
            gates = torch.cat([p[:, : span.size] for p, span in zip(parts, spans, strict=True)], dim=1)
            ups = torch.cat([p[:, span.size :] for p, span in zip(parts, spans, strict=True)], dim=1)
            assert torch.equal(gates, whole[:, :half]) and torch.equal(ups, whole[:, half:])
        elif name.endswith("experts.w2.weight"):  # [E, H, I]
            assert torch.equal(torch.cat(parts, dim=2), whole)
        elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):  # replicated
            assert all(torch.equal(p, whole) for p in parts)
    layer = _load(model_dir, TensorParallel(1, 2)).model.layers[0].mlp
    assert layer.experts.w13.weight.shape == (8, 2 * spans[1].size, 64)


def test_tensor_parallel_partial_sums_add_up_to_the_block(tiny_model_factory) -> None:
    """Each rank's MoE block output before the all-reduce, summed over ranks, is the tp-1 output."""
    model_dir = tiny_model_factory("mixtral", **{**FAMILIES["mixtral"][1], "intermediate_size": 128})
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    blocks = [_load(model_dir, TensorParallel(r, 2)).model.layers[1].mlp for r in range(2)]
    # With a fake size-2 group, all_reduce would call torch.distributed: use the rank blocks' parts instead.
    partial = []
    for block in blocks:
        weights, ids = select_experts(block.gate(x), block.top_k, block.renormalize)
        partial.append(block.experts(x, weights, ids))
    expected = _load(model_dir).model.layers[1].mlp(x)
    torch.testing.assert_close(partial[0] + partial[1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_tensor_parallel_worker_processes_generate_the_one_process_tokens(tiny_model_factory) -> None:
    """tp 2 over real worker processes (gloo): experts split along their intermediate dimension, shared expert
    and dense layer too, one all-reduce per block; greedy tokens equal tp 1's, logprobs to float rounding."""
    model_dir = tiny_model_factory("qwen2_moe", **{**FAMILIES["qwen2_moe"][1], "moe_intermediate_size": 64})
    prompts = _prompts(load_model_config(model_dir).vocab_size, [21, 5, 40], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    runs = {}
    for tp_size in (1, 2):
        with LLM(model_dir, tensor_parallel_size=tp_size, dtype="float32", max_model_len=128,
                 max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20, enforce_eager=True) as llm:  # fmt: skip
            runs[tp_size] = llm.generate(prompts, params)
    for one, two in zip(runs[1], runs[2], strict=True):
        assert two.output_token_ids == one.output_token_ids
        got, want = ([lp.logprob for lp in o.new_logprobs] for o in (two, one))
        assert got == pytest.approx(want, abs=1e-4)


def test_int4_group_size_is_checked_against_the_experts(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen2_moe", **{**FAMILIES["qwen2_moe"][1], "moe_intermediate_size": 96})
    config = load_model_config(model_dir)
    check_model_supported(config, QuantizationConfig("int4", 32))
    with pytest.raises(ValueError, match=r"experts' w2 \(moe_intermediate_size\) K = 96"):
        check_model_supported(config, QuantizationConfig("int4", 64))


def test_prequantized_moe_checkpoints_are_refused_before_loading(moe_model_dirs, tmp_path) -> None:
    model_dir = tmp_path / "gptq-mixtral"
    shutil.copytree(moe_model_dirs["mixtral"], model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="Mixture-of-Experts checkpoints are not supported"):
        resolve_quantization(model_dir, load_model_config(model_dir), QuantizationConfig("none"))


def _runner(model_dir: Path, quantization: QuantizationConfig | None = None) -> ModelRunner:
    config, backend = load_model_config(model_dir), TorchAttentionBackend()
    model = load_model(config, torch.float32, torch.device("cpu"), backend)
    if quantization is not None:
        quantize_model(model, quantization)
    allocate_kv_caches(model, KVCacheSpec(32, 8, torch.float32), torch.device("cpu"))
    return ModelRunner(model, backend, 8, config.eos_token_ids, 0)


def _greedy(runner: ModelRunner, prompt: list[int], num_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """(greedy tokens, each step's logits) through the paged cache."""
    scheduler = HandScheduler(num_blocks=32, block_size=8)
    scheduler.add("r", prompt)
    tokens, logits = [], []
    for _ in range(num_new):
        step = runner.forward(scheduler.schedule())
        logits.append(step.logits[0])
        tokens.append(runner.sample(step).sampled_token_ids["r"][0])
        scheduler.append("r", tokens[-1])
    scheduler.finish("r")
    runner.forward(scheduler.schedule())  # an empty step that drops the request from the runner's batch
    return tokens, logits


def _margin(logits: list[torch.Tensor]) -> float:
    """The smallest gap between the top two logits over the steps: how clear-cut greedy decoding was."""
    return min(float(top[0] - top[1]) for top in (step.topk(2).values for step in logits))


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_quantized_experts_track_the_float_model(family, method, moe_model_dirs) -> None:
    """Weight-only int8/int4 swaps every expert (not the router, not the shared-expert gate); the logits stay
    close to the float model's and the greedy tokens of an easy prompt are the same.

    Random Gaussian weights are int4's worst case (~10-15% relative logit error here, measured against the
    dequantized weights' exact product: the kernels add ~0.5%), so the easy prompt is the one of eight on which
    the float model decides most clearly."""
    model_dir = moe_model_dirs[family]
    float_runner = _runner(model_dir)
    runner = _runner(model_dir, QuantizationConfig(method, 32))
    blocks = [layer.mlp for layer in runner.model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(isinstance(b.experts, QuantizedExperts) and b.experts.method == method for b in blocks)
    assert not any(isinstance(m, FusedExperts) for m in runner.model.modules())
    assert all(b.gate.weight.dtype == torch.float32 for b in blocks)
    candidates = _prompts(runner.model.config.vocab_size, [12] * 8, seed=4)
    runs = [(prompt, *_greedy(float_runner, prompt, 4)) for prompt in candidates]
    prompt, expected_tokens, expected_logits = max(runs, key=lambda run: _margin(run[2]))
    tokens, logits = _greedy(runner, prompt, 4)
    assert tokens == expected_tokens
    for quantized, reference in zip(logits, expected_logits, strict=True):
        error = (quantized - reference).norm() / reference.norm()
        assert error < (0.03 if method == "int8" else 0.2), error
