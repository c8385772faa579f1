"""Every dense family on tiny random checkpoints built by transformers' own config classes, against transformers.

Per family: the model runner's logits at every step of a ragged, chunked batch (prompts longer than the
sliding window where the family has one, prefix-cache hits, preemption into dirty blocks), and the whole
engine (scheduler, block pool, KV budget small enough to preempt, prefix caching, the C++ CPU attention
kernel) generating greedy tokens identical to transformers' `generate`, with logprobs within tolerance.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hpi_runtime.llm import LLM
from hpi_runtime.models.config import load_model_config
from hpi_runtime.sampling_params import SamplingParams

from .conftest import HandScheduler
from .test_parity import _hf_model, _prompts, _run_and_compare

WINDOW = 8  # tokens: prompts and generations run well past it
BLOCK_SIZE = 4  # runner tests: whole blocks fall out of the window
ENGINE_BLOCK_SIZE = 8  # the engine's smallest

LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    # head_dim 16 x partial_rotary_factor 0.5: 4 frequencies
    "short_factor": [1.0, 1.3, 2.1, 3.0],
    "long_factor": [1.2, 2.5, 4.0, 9.0],
    "original_max_position_embeddings": 32,
}
# name -> (tiny_model_factory arch, config overrides)
FAMILIES = {
    "qwen3": ("qwen3", {"tie_word_embeddings": False}),
    "phi3": ("phi3", {"tie_word_embeddings": False}),
    "phi3-longrope-partial": (
        "phi3",
        {
            "rope_parameters": LONGROPE,
            "original_max_position_embeddings": 32,  # Phi3Config copies its own into rope_parameters
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 128,
        },
    ),
    "gemma2": (
        "gemma2",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 1.5,  # small enough to bite on these scores
            "final_logit_softcapping": 4.0,
            "num_layers": 3,
        },
    ),
    "gemma3": (
        "gemma3",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            "num_layers": 4,
            "query_pre_attn_scalar": 16,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        },
    ),
    "mistral-sliding": ("mistral", {"sliding_window": WINDOW, "num_heads": 6, "num_kv_heads": 2, "hidden_size": 96}),
    "llama3.1-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
}


@pytest.fixture(scope="module")
def family_dir(tiny_model_factory):
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            arch, overrides = FAMILIES[name]
            built[name] = tiny_model_factory(arch, **overrides)
        return built[name]

    return get


def test_configs_read_family_choices(family_dir) -> None:
    gemma2 = load_model_config(family_dir("gemma2"))
    assert gemma2.layer_sliding_windows == (WINDOW, None, WINDOW)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (1.5, 4.0)
    assert gemma2.attention_scale == 24**-0.5 and gemma2.norm_unit_offset and gemma2.scale_embeddings
    gemma3 = load_model_config(family_dir("gemma3"))
    assert gemma3.layer_sliding_windows == (WINDOW, None, WINDOW, WINDOW) and gemma3.qk_norm
    assert (gemma3.rope.rope_type, gemma3.rope.theta, gemma3.sliding_rope.theta) == ("linear", 1e5, 500.0)
    assert gemma3.attn_logit_softcap is None  # transformers never applies it to Gemma 3
    phi3 = load_model_config(family_dir("phi3-longrope-partial"))
    assert phi3.rope.rope_type == "longrope" and phi3.rope.partial_rotary_factor == 0.5
    assert phi3.rope.attention_factor == pytest.approx((1 + torch.tensor(4.0).log() / torch.tensor(32.0).log()) ** 0.5)
    assert not phi3.rope.use_long_factor and phi3.for_max_model_len(33).rope.use_long_factor
    assert not phi3.for_max_model_len(32).rope.use_long_factor
    assert load_model_config(family_dir("mistral-sliding")).layer_sliding_windows == (WINDOW, WINDOW)


@pytest.mark.parametrize("family", ["llama3.1-rope", "phi3-longrope-partial", "gemma3"])
def test_rope_frequencies_equal_transformers(family, family_dir) -> None:
    """Inverse frequencies and cos/sin scale exactly as transformers' own RoPE init functions compute them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hpi_runtime.models.rotary import rope_inv_freq

    model_dir = family_dir(family)
    hf_config, config = AutoConfig.from_pretrained(model_dir), load_model_config(model_dir)
    if family == "gemma3":  # one RoPE per layer type
        expected, _ = ROPE_INIT_FUNCTIONS["linear"](hf_config, layer_type="full_attention")
        torch.testing.assert_close(rope_inv_freq(config.rope, config.head_dim), expected, atol=0, rtol=0)
        base, dim = config.sliding_rope.theta, config.head_dim
        expected = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        torch.testing.assert_close(rope_inv_freq(config.sliding_rope, dim), expected, atol=0, rtol=0)
        return
    rope_type = config.rope.rope_type
    for use_long, seq_len in ((False, None), (True, config.rope.original_max_position_embeddings + 1)):
        expected, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, seq_len=seq_len)
        rope = dataclasses.replace(config.rope, use_long_factor=use_long)
        torch.testing.assert_close(rope_inv_freq(rope, config.head_dim), expected, atol=0, rtol=0)
        assert (config.rope.attention_factor if rope_type == "longrope" else 1.0) == pytest.approx(attention_factor)


# LongRoPE switches factors when a forward call crosses the original length in transformers, per engine here
# (ModelConfig.for_max_model_len): it is compared at the engine level, on sequences past that length.
RUNNER_FAMILIES = [f for f in FAMILIES if "longrope" not in f]


@pytest.mark.parametrize("chunk_size", [None, 5], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("family", RUNNER_FAMILIES)
def test_runner_logits_match_transformers(family, chunk_size, family_dir, make_runner) -> None:
    model_dir = family_dir(family)
    runner, hf_model = make_runner(model_dir, num_blocks=96, block_size=BLOCK_SIZE), _hf_model(model_dir)
    vocab_size = runner.model.config.vocab_size
    scheduler = HandScheduler(num_blocks=96, block_size=BLOCK_SIZE, chunk_size=chunk_size)
    shared, *others = _prompts(vocab_size, [12, 3, 21, 1, 26], seed=7)
    scheduler.add("a", shared + others[0])
    for i, prompt in enumerate(others[1:]):
        scheduler.add(f"r{i}", prompt)

    def prefix_hit(s: HandScheduler) -> None:  # 12 cached tokens, then its own 5
        s.add("b", shared + _prompts(vocab_size, [5], seed=8)[0], shared_prefix_of="a", num_shared_blocks=3)

    def preempt(s: HandScheduler) -> None:
        s.preempt("r1")  # recomputed from scratch into (dirty) reused blocks

    checked = _run_and_compare(runner, hf_model, scheduler, num_steps=12, events={3: prefix_hit, 6: preempt})
    assert checked >= 40


def _hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), generation_config=config, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def _check_teacher_forced(hf_model, prompt: list[int], output, atol: float) -> None:
    ids = torch.tensor([prompt + list(output.output_token_ids)])
    with torch.no_grad():
        logprobs = hf_model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    ours = torch.tensor([lp.logprob for lp in output.new_logprobs])
    expected = logprobs.gather(1, torch.tensor(output.output_token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(ours, expected, atol=atol, rtol=0)


def _tiny_pool_llm(model_dir: Path, dtype: str = "float32", enforce_eager: bool = True, **kwargs) -> LLM:
    config = load_model_config(model_dir)
    bytes_per_block = ENGINE_BLOCK_SIZE * config.kv_bytes_per_token({"float32": 4, "bfloat16": 2}[dtype])
    return LLM(
        model_dir,
        dtype=dtype,
        block_size=ENGINE_BLOCK_SIZE,
        max_model_len=96,
        max_num_batched_tokens=24,  # chunked prefill
        kv_cache_memory_bytes=16 * bytes_per_block,  # 128 tokens: the first batch cannot all run at once
        enforce_eager=enforce_eager,
        **kwargs,
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_greedy_matches_transformers_generate(family, family_dir) -> None:
    model_dir = family_dir(family)
    hf_model = _hf_model(model_dir)
    # Gemma 3 also runs compiled (the step graph holds its windows, soft-caps and two RoPE tables).
    llm = _tiny_pool_llm(model_dir, enforce_eager=family != "gemma3")
    vocab_size = len(llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    # LongRoPE with max_model_len past the original 32 uses the long factors everywhere, as transformers does
    # for sequences longer than 32: so every sequence is.
    extra = 33 if "longrope" in family else 0
    prompts = _prompts(vocab_size, [40 + extra, 5 + extra, 23 + extra, 33 + extra], seed=9)
    outputs = llm.generate(prompts, params)
    if None in load_model_config(model_dir).layer_sliding_windows:
        assert llm.engine.get_stats().num_preemptions > 0
    # else every layer is windowed: the KV manager frees blocks that fall out of the window, and this pool
    # holds the batch (the runner test above preempts such models too)
    shared = prompts[0][: 24 + extra - extra % ENGINE_BLOCK_SIZE]
    second = [shared + tail for tail in _prompts(vocab_size, [3, 10], seed=10)]
    outputs += llm.generate(second, params)
    assert llm.engine.get_stats().prefix_cache_hits >= len(shared)
    for prompt, output in zip(prompts + second, outputs, strict=True):
        assert list(output.output_token_ids) == _hf_greedy(hf_model, prompt, 12)
        _check_teacher_forced(hf_model, prompt, output, atol=2e-4)


@pytest.mark.parametrize("family", ["gemma2", "phi3-longrope-partial"])
def test_bfloat16_tracks_transformers(family, family_dir) -> None:
    model_dir = family_dir(family)
    hf_model = _hf_model(model_dir)  # fp32: the ground truth
    llm = _tiny_pool_llm(model_dir, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = _prompts(len(llm.tokenizer), [37, 45], seed=11)
    for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
        _check_teacher_forced(hf_model, prompt, output, atol=0.1)


def test_longrope_short_factors_below_the_original_length(family_dir) -> None:
    # An engine that never passes original_max_position_embeddings (32) keeps the short factors throughout,
    # as transformers does for such sequences.
    model_dir = family_dir("phi3-longrope-partial")
    hf_model = _hf_model(model_dir)
    llm = LLM(model_dir, dtype="float32", block_size=ENGINE_BLOCK_SIZE, max_model_len=32, enforce_eager=True,
              kv_cache_memory_bytes=1 << 20)  # fmt: skip
    assert not llm.engine.executor.model.config.rope.use_long_factor
    prompt = _prompts(len(llm.tokenizer), [20], seed=12)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    output = llm.generate([prompt], params)[0]
    assert list(output.output_token_ids) == _hf_greedy(hf_model, prompt, 12)
    _check_teacher_forced(hf_model, prompt, output, atol=2e-4)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weight_only_quantization_runs_new_families(quantization, family_dir) -> None:
    model_dir = family_dir("gemma2")
    hf_model = _hf_model(model_dir)
    llm = _tiny_pool_llm(model_dir, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompt = _prompts(len(llm.tokenizer), [30], seed=13)[0]
    _check_teacher_forced(hf_model, prompt, llm.generate([prompt], params)[0], atol=0.5)
