"""The real engine (scheduler + block pool) over the model runner on a tiny model: parity with transformers
through chunked prefill, prefix-cache hits and preemption; seeds; batch invariance; create_engine; what the
model directory decides (BOS, generation_config defaults, chat template, Hub download); LM-head quantization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hpi_runtime.config import EngineArgs
from hpi_runtime.engine_factory import create_engine
from hpi_runtime.llm import LLM
from hpi_runtime.models.linear import LinearBase
from hpi_runtime.quantization.linear import QuantizedLinear
from hpi_runtime.quantization.quantize import QuantizedLMHead
from hpi_runtime.sampling_params import SamplingParams


def _prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _check_against_transformers(hf_model, prompt: list[int], output) -> None:
    """Teacher-forced: each generated token is transformers' argmax and its logprob matches."""
    ids = torch.tensor([prompt + list(output.output_token_ids)])
    with torch.no_grad():
        logprobs = hf_model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    assert list(output.output_token_ids) == logprobs.argmax(-1).tolist()
    ours = torch.tensor([lp.logprob for lp in output.new_logprobs])
    expected = logprobs.gather(1, torch.tensor(output.output_token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=0)


def test_engine_parity_with_chunking_prefix_hits_and_preemption(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    block_size, max_model_len = 8, 96
    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=40,  # prompts up to 60 tokens: chunked prefill
        # 2 layers x 2 kv heads x 16 dims x K,V x 4 bytes = 512 bytes per token: 16 blocks, one full request
        kv_cache_memory_bytes=16 * block_size * 512,
    )
    vocab_size = len(llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = _prompts(vocab_size, [60, 5, 23, 41, 12, 33], seed=0)
    outputs = llm.generate(prompts, params)
    assert llm.engine.get_stats().num_preemptions > 0
    shared = prompts[0][:40]  # 5 full blocks, cached from the first batch
    second = [shared + tail for tail in _prompts(vocab_size, [3, 11], seed=1)]
    outputs += llm.generate(second, params)
    assert llm.engine.get_stats().prefix_cache_hits >= 40  # the whole shared prefix, at least once
    for prompt, output in zip(prompts + second, outputs, strict=True):
        assert len(output.output_token_ids) == 24
        _check_against_transformers(hf_model, prompt, output)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", block_size=8, max_model_len=128, kv_cache_memory_bytes=1 << 22)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm: LLM) -> None:
    prompt = _prompts(len(tiny_llm.tokenizer), [9], seed=2)[0]
    others = _prompts(len(tiny_llm.tokenizer), [4, 17, 30], seed=3)

    def sample(seed: int, top_k: int = 0) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_k=top_k, max_tokens=20, seed=seed, ignore_eos=True)

    alone = tiny_llm.generate([prompt], sample(7))[0].output_token_ids
    again = tiny_llm.generate([prompt], sample(7))[0].output_token_ids
    in_batch = tiny_llm.generate(others[:1] + [prompt] + others[1:], [sample(1), sample(7), sample(2), sample(3)])
    assert alone == again == in_batch[1].output_token_ids
    assert tiny_llm.generate([prompt], sample(8))[0].output_token_ids != alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    assert len({tiny_llm.generate([prompt], unseeded)[0].output_token_ids for _ in range(3)}) > 1


def test_greedy_output_does_not_depend_on_the_batch(tiny_llm: LLM) -> None:
    prompts = _prompts(len(tiny_llm.tokenizer), [7, 50, 2, 19, 33], seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batched = [o.output_token_ids for o in tiny_llm.generate(prompts, greedy)]
    assert [tiny_llm.generate([p], greedy)[0].output_token_ids for p in prompts[:2]] == batched[:2]


def test_generation_stops_and_min_tokens(tiny_llm: LLM) -> None:
    prompt = _prompts(len(tiny_llm.tokenizer), [6], seed=5)[0]
    first = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0]
    stop_id = first.output_token_ids[1]
    expected = first.output_token_ids[: first.output_token_ids.index(stop_id) + 1]
    stopped = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop_id,)))
    assert stopped[0].output_token_ids == expected and stopped[0].finish_reason == "stop"
    held = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=(stop_id,))
    assert stop_id not in tiny_llm.generate([prompt], held)[0].output_token_ids[:4]


def test_create_engine_bundle_and_errors(tiny_model_dir: Path) -> None:
    bundle = create_engine(
        EngineArgs.from_options(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 20)
    )
    assert bundle.resolved.model_name == tiny_model_dir.name and bundle.resolved.model_dir == tiny_model_dir
    assert bundle.resolved.max_model_len == 512 and bundle.resolved.eos_token_ids == frozenset({2})
    assert (bundle.resolved.dtype, bundle.resolved.device) == ("float32", "cpu")
    footprint = bundle.footprint
    assert footprint.num_kv_blocks == (1 << 20) // (16 * 512)
    assert footprint.kv_cache_bytes == footprint.num_kv_blocks * 16 * 512
    assert bundle.footprint.weight_bytes == sum(p.numel() * 4 for p in bundle.engine.executor.model.parameters())
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        create_engine(EngineArgs.from_options(model=str(tiny_model_dir), max_model_len=1024))
    with pytest.raises(ValueError, match="dtype must be"):
        create_engine(EngineArgs.from_options(model=str(tiny_model_dir), dtype="float64"))
    with pytest.raises(ValueError, match="KV cache budget"):
        create_engine(EngineArgs.from_options(model=str(tiny_model_dir), kv_cache_memory_bytes=1 << 10))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_engine(EngineArgs.from_options(model=str(tiny_model_dir / "nope")))


def test_bfloat16_tracks_float32(tiny_model_dir: Path, tiny_llm: LLM) -> None:
    prompt = _prompts(len(tiny_llm.tokenizer), [11], seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    bf16 = LLM(tiny_model_dir, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=1 << 20)
    assert bf16.bundle.resolved.dtype == "bfloat16"
    reference = tiny_llm.generate([prompt], params)[0]
    output = bf16.generate([prompt], params)[0]
    assert output.output_token_ids[:3] == reference.output_token_ids[:3]
    first = torch.tensor([lp.logprob for lp in output.new_logprobs[:3]])
    torch.testing.assert_close(
        first, torch.tensor([lp.logprob for lp in reference.new_logprobs[:3]]), atol=0.05, rtol=0
    )


def test_text_prompts_chat_and_default_params(tiny_llm: LLM) -> None:
    tokenizer = tiny_llm.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = tiny_llm.generate(["Hello world", "The capital of"], params)
    assert [len(o.output_token_ids) for o in outputs] == [4, 4]
    assert outputs[0].prompt_token_ids == tuple(tokenizer("Hello world").input_ids)
    assert outputs[1].text == tokenizer.decode(outputs[1].output_token_ids, skip_special_tokens=True)
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Stop here."}]]
    chats = tiny_llm.chat(conversations, params)
    expected = tokenizer.apply_chat_template(
        conversations[1], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chats[1].prompt_token_ids == tuple(expected)
    assert len(tiny_llm.generate([[5, 6, 7]])[0].output_token_ids) <= SamplingParams().max_tokens
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        tiny_llm.generate([[5, 6]], [params, params])


def test_vllm_prompt_forms_and_bad_prompts(tiny_llm: LLM) -> None:
    """vLLM's prompt forms give what text and token ids give; a prompt of another kind or a token id outside the
    vocabulary is a ValueError before anything runs (it once reached the engine step and failed there)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = tiny_llm.tokenizer("Hello world").input_ids
    expected = tiny_llm.generate(["Hello world"], params)[0].output_token_ids
    forms = [{"prompt": "Hello world"}, {"prompt_token_ids": ids}, ids, torch.tensor(ids).tolist()]
    assert [o.output_token_ids for o in tiny_llm.generate(forms, params)] == [expected] * 4
    assert tiny_llm.generate({"prompt_token_ids": ids}, params)[0].output_token_ids == expected  # one prompt
    assert tiny_llm.generate(ids, params)[0].output_token_ids == expected
    assert tiny_llm.generate([torch.tensor(ids)], params)[0].output_token_ids == expected  # __index__ ints
    assert tiny_llm.generate(torch.tensor(ids), params)[0].output_token_ids == expected
    vocab = len(tiny_llm.tokenizer)
    bad = [([{"prompt_token_ids": ids, "prompt": "x"}], "one key"), ([{"text": "x"}], "one key"),
           ([[1, "2"]], "list of token ids"), ([[1.5]], "list of token ids"), ([[True]], "list of token ids"),
           ([ids, [3, -1]], "prompt 1: token id -1 is outside"), ([[vocab + 5]], f"token id {vocab + 5} is outside"),
           ([42.0], "expected text"), ([torch.tensor([[1, 2]])], "list of token ids")]  # fmt: skip
    for prompts, message in bad:
        with pytest.raises(ValueError, match=message):
            tiny_llm.generate(prompts, params)
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.generate(["Hello world"], params)[0].output_token_ids == expected


def _small_llm(model_dir: Path, **options) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 20, **options)


def _copy_model(model_dir: Path, out: Path) -> Path:
    return Path(shutil.copytree(model_dir, out / model_dir.name))


def test_text_prompts_start_with_bos_when_the_tokenizer_adds_one(tiny_model_factory) -> None:
    llm = _small_llm(tiny_model_factory("llama", add_bos_token=True))
    bos_id = llm.tokenizer.bos_token_id
    plain = llm.tokenizer.encode("Hello world", add_special_tokens=False)
    assert bos_id is not None and plain[0] != bos_id  # so only the tokenizer's special tokens can put it there
    output = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert output.prompt_token_ids == (bos_id, *plain)


@pytest.mark.parametrize(
    "generation_config",
    [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 1}],
    ids=["temperature-0", "top-k-1"],
)
def test_generation_config_sampling_defaults_apply_without_params(
    tiny_model_dir: Path, tmp_path: Path, generation_config: dict
) -> None:
    model_dir = _copy_model(tiny_model_dir, tmp_path)
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **generation_config}))
    llm = _small_llm(model_dir)
    prompts = _prompts(len(llm.tokenizer), [5, 9, 14, 3, 20, 7], seed=7)
    # Without the defaults these would be unseeded temperature-1 draws: 6 x 16 of them all landing on the
    # argmax does not happen on this model.
    defaults = [o.output_token_ids for o in llm.generate(prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=SamplingParams().max_tokens)
    assert defaults == [o.output_token_ids for o in llm.generate(prompts, greedy)]


def test_chat_template_from_tokenizer_config_is_used(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_model(tiny_model_dir, tmp_path)
    (model_dir / "chat_template.jinja").unlink()
    template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ': ' + message['content'] + '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'assistant says:' }}{% endif %}"
    )
    config_path = model_dir / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": template}))
    llm = _small_llm(model_dir)
    conversation = [{"role": "user", "content": "Hello world"}]
    output = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=2))[0]
    options = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
    expected = llm.tokenizer.apply_chat_template(conversation, chat_template=template, **options)
    assert output.prompt_token_ids == tuple(expected)
    chatml = llm.tokenizer.apply_chat_template(
        conversation, chat_template=tiny_model_dir.joinpath("chat_template.jinja").read_text(), **options
    )
    assert tuple(chatml) != output.prompt_token_ids


def test_lm_head_is_quantized_only_when_asked(tiny_model_factory, tiny_model_dir: Path) -> None:
    untied = tiny_model_factory("llama", tie_word_embeddings=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for quantize_lm_head in (False, True):
        llm = _small_llm(untied, quantization="int8", quantize_lm_head=quantize_lm_head)
        model = llm.engine.executor.model
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
        assert isinstance(model.lm_head, QuantizedLMHead) == quantize_lm_head
        assert not any(isinstance(m, LinearBase) for m in model.modules())
        assert len(llm.generate([[5, 6, 7]], params)[0].output_token_ids) == 4
        llm.shutdown()
    tied = _small_llm(tiny_model_dir, quantization="int4", quantize_lm_head=True)  # the head goes to int8
    model = tied.engine.executor.model
    assert isinstance(model.lm_head, QuantizedLMHead) and model.lm_head.method == "int8"
    assert model.model.embed_tokens.rows_from is model.lm_head
    assert len(tied.generate([[5, 6, 7]], params)[0].output_token_ids) == 4
    tied.shutdown()
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization"):
        create_engine(EngineArgs.from_options(model=str(untied), quantize_lm_head=True, kv_cache_memory_bytes=1 << 20))


def test_priority_orders_admission_in_the_offline_api(tiny_model_dir: Path) -> None:
    llm = _small_llm(tiny_model_dir, max_num_seqs=1)  # one request at a time: the order of admission shows
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    outputs = llm.generate(prompts, params, priority=[2, 0, 1])
    order = sorted(range(3), key=lambda i: outputs[i].first_scheduled_time)
    assert order == [1, 2, 0]
    assert [o.prompt_token_ids for o in outputs] == [tuple(p) for p in prompts]  # results stay in prompt order
    fifo = llm.generate(prompts, params)
    assert sorted(range(3), key=lambda i: fifo[i].first_scheduled_time) == [0, 1, 2]
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(prompts, params, priority=[0, 1])
