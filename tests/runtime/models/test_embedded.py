"""The embedded SmolLM2-135M-Instruct end to end: greedy generation equals transformers token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_runtime.llm import LLM
from hpi_runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Kubernetes operators reconcile",
    "1, 2, 3, 4,",
    "Translate to French: Good morning, how are you?",
    # long enough to be prefilled in several chunks (max_num_batched_tokens below)
    "A paged KV cache splits the keys and values of every sequence into fixed-size blocks. " * 9,
]
CHAT = [{"role": "user", "content": "Write a haiku about GPUs."}]


@pytest.fixture(scope="module")
def embedded_llm(embedded_model_dir: Path) -> LLM:
    return LLM(
        embedded_model_dir,
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=96,
        kv_cache_memory_bytes=64 << 20,
    )


@pytest.fixture(scope="module")
def prompt_token_ids(embedded_llm: LLM) -> list[list[int]]:
    tokenizer = embedded_llm.tokenizer
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return ids + [
        list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
    ]


def test_greedy_equals_transformers(embedded_llm: LLM, embedded_model_dir: Path, prompt_token_ids) -> None:
    from transformers import AutoModelForCausalLM

    # min_tokens bans EOS so that every prompt yields NUM_NEW_TOKENS tokens to compare.
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    ours = [list(o.output_token_ids) for o in embedded_llm.generate(prompt_token_ids, params)]
    hf_model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()
    eos_ids = sorted(embedded_llm.bundle.resolved.eos_token_ids)
    for prompt, generated in zip(prompt_token_ids, ours, strict=True):
        # Teacher-forced greedy: one forward over prompt + our tokens; transformers' argmax at every
        # position must be our next token, which is exactly what its token-by-token greedy search checks.
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
        logits[:, eos_ids] = float("-inf")
        assert logits.argmax(-1).tolist() == generated, embedded_llm.tokenizer.decode(prompt)
    # And literally transformers' generate (KV-cached greedy search) for one prompt (the chat one).
    prompt = prompt_token_ids[-1]
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NUM_NEW_TOKENS,
            min_new_tokens=NUM_NEW_TOKENS,
        )[0, len(prompt) :].tolist()
    assert expected == ours[-1]


def test_chat_answers_paris(embedded_llm: LLM) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    output = embedded_llm.chat(question, SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert output.text.strip() == "The capital of France is Paris."
    assert output.finish_reason == "stop" and output.output_token_ids[-1] == 2


def test_the_checkpoint_holds_bf16_weights_and_an_older_conversion_is_redone(embedded_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    """Saved in bf16 (SmolLM2's published dtype): an AVX2 CPU's fp32 model keeps them as bf16 panels. A directory
    without this conversion's format file (the fp32 one of before) is not taken as converted."""
    from safetensors import safe_open

    from hpi_runtime.embedded import FORMAT, FORMAT_FILE, _converted

    with safe_open(str(next(embedded_model_dir.glob("*.safetensors"))), "pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    assert dtypes == {"BF16"}
    assert _converted(embedded_model_dir)
    older = tmp_path / "older"
    older.mkdir()
    (older / "config.json").write_text("{}")
    (older / "model.safetensors").write_bytes(b"")
    assert not _converted(older)
    (older / FORMAT_FILE).write_text(FORMAT)
    assert _converted(older)
