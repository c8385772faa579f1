"""The official `openai` client against a real `hpi serve` process (tiny random model, CPU)."""

from __future__ import annotations

import openai
import pytest

from hpi_testing.tiny_model import build_tokenizer

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama"]


def test_chat_usage_counts_template_tokens(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
    tokenizer = build_tokenizer()
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    prompt_ids = getattr(prompt_ids, "input_ids", prompt_ids)
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == 8
    assert result.usage.total_tokens == len(prompt_ids) + 8
    assert result.choices[0].finish_reason == "length"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_with_n2_finishes_each_choice(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny-llama", messages=MESSAGES, n=2, max_tokens=6, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finishes: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert sorted(texts) == [0, 1] and all(texts.values()), texts
    assert finishes == {0: ["length"], 1: ["length"]}
    # Each choice has its own seed (seed + index), so streaming reproduces the non-streamed choices.
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_stream_usage_in_the_last_chunk(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    chunks = list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    num_prompt = len(build_tokenizer()(prompt).input_ids)
    *body, last = chunks
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        num_prompt, 7, num_prompt + 7)
    assert all(chunk.usage is None for chunk in body)
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]


def test_completion_stream_equals_non_stream_and_token_prompts(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny-llama", prompt="The capital of France is", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    prompt_ids = build_tokenizer()("The capital of France is").input_ids
    by_ids = client.completions.create(**{**kwargs, "prompt": prompt_ids})
    assert by_ids.choices[0].text == whole.choices[0].text
    assert by_ids.usage.prompt_tokens == len(prompt_ids)


def test_stop_string_truncates_output(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny-llama", prompt="one two three", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[6:9]
    assert len(stop) == 3, full
    expected = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**kwargs, stop=[stop], stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            choice = client.completions.create(**kwargs, stop=[stop]).choices[0]
            text, finish = choice.text, [choice.finish_reason]
        assert text == expected
        assert finish == ["stop"]


def test_seed_reproducible_and_seeds_differ(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_n_choices_are_distinct_and_counted(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, n=3, max_tokens=6,
                                            temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert len({c.message.content for c in result.choices}) > 1
    assert result.usage.completion_tokens == 18


def test_chat_logprobs_top_alternatives(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    result = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0
