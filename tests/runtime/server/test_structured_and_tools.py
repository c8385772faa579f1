"""Structured outputs, tool calling and the rest of the OpenAI surface, with the official `openai` client
against a real `hpi serve` (a tiny random model whose chat template renders tools; hermes tool-call parser).

The model is random, so only a grammar makes its output well-formed: every check below fails without one.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest

from hpi_testing.server import RuntimeServer, post_json
from hpi_testing.tools_template import HERMES_TOOLS_TEMPLATE

NAME = "tiny-tools"
ORIGIN = "http://app.example"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Madrid"]
    temperature_c: int = pydantic.Field(ge=-40, le=50)
    sunny: bool


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    model_dir: Path = tiny_model_factory("llama", max_position_embeddings=2048)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = HERMES_TOOLS_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    log = tmp_path_factory.mktemp("server") / "server.log"
    with RuntimeServer(model_dir, log, "--served-model-name", NAME, "--max-model-len", "2048",
                       "--kv-cache-memory", "8MiB", "--dtype", "float32", "--enforce-eager",
                       "--tool-call-parser", "hermes", "--allowed-origins", ORIGIN,
                       "--max-num-batched-tokens", "256") as running:  # long prompts run in chunks
        running.model_dir = model_dir
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


# -- structured outputs ------------------------------------------------------------------------------------

def test_pydantic_model_through_parse_validates(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        result = client.chat.completions.parse(model=NAME, messages=MESSAGES, response_format=Weather, n=2,
                                               temperature=temperature, seed=3, max_tokens=64)
        for choice in result.choices:
            assert isinstance(choice.message.parsed, Weather), choice.message.content


def test_json_object_always_parses(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=NAME, messages=MESSAGES, response_format={"type": "json_object"},
                                            n=4, temperature=1.0, seed=11, max_tokens=96)
    for choice in result.choices:
        assert isinstance(json.loads(choice.message.content), dict)


def test_regex_constrained_stream_matches(client: openai.OpenAI) -> None:
    pattern = r"[a-z]{3}-[0-9]{2}"
    chunks = list(client.completions.create(model=NAME, prompt="Code:", n=3, temperature=1.0, seed=1, max_tokens=16,
                                            stream=True, extra_body={"guided_regex": pattern}))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert len(texts) == 3 and all(re.fullmatch(pattern, t) for t in texts.values()), texts


def test_choice_constrained_greedy_and_sampled(client: openai.OpenAI) -> None:
    choices = ["yes", "no", "it depends"]
    for temperature in (0.0, 1.0):
        result = client.chat.completions.create(model=NAME, messages=MESSAGES, n=3, temperature=temperature, seed=2,
                                                max_tokens=16, extra_body={"guided_choice": choices})
        assert all(c.message.content in choices for c in result.choices), [c.message.content for c in result.choices]
        assert all(c.finish_reason == "stop" for c in result.choices)


@pytest.mark.parametrize("constrained", [True, False], ids=["grammar", "broken-no-grammar"])
def test_ebnf_grammar_is_followed(client: openai.OpenAI, constrained: bool) -> None:
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    extra = {"guided_grammar": grammar} if constrained else {}
    result = client.completions.create(model=NAME, prompt="Sum:", n=4, max_tokens=24, temperature=1.0, seed=4,
                                       extra_body=extra)

    def followed() -> None:
        for choice in result.choices:
            if choice.finish_reason == "stop":  # a whole sentence of the grammar
                assert re.fullmatch(r"\([0-9](\+[0-9])*\)", choice.text), choice.text
            else:  # cut off by max_tokens: the start of one, which random tokens are not
                assert choice.finish_reason == "length", choice.finish_reason
                assert re.fullmatch(r"\(([0-9](\+[0-9])*\+?)?", choice.text), choice.text
        # ")" is allowed after every digit: among four samples of 24 tokens, some close (and the grammar stops them).
        assert any(c.finish_reason == "stop" for c in result.choices), [c.text for c in result.choices]

    if not constrained:
        with pytest.raises(AssertionError):
            followed()
        return
    followed()


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"guided_regex": "a[b"}, "guided_regex", "Unclosed"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
])
def test_bad_constraints_are_400_naming_the_problem(client: openai.OpenAI, extra, param, words) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, extra_body=extra)
    error = info.value.body
    assert error["param"] == param and words in error["message"], error


# -- tool calling --------------------------------------------------------------------------------------------

def test_tool_round_trip(client: openai.OpenAI, server) -> None:
    first = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=48, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Rome") and arguments["unit"] in ("c", "f")

    conversation = [*MESSAGES, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 degrees"}]
    final = client.chat.completions.create(model=NAME, messages=conversation, tools=[WEATHER_TOOL, TIME_TOOL],
                                           max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.usage.prompt_tokens > first.usage.prompt_tokens
    # The template rendered the call and its result into the prompt the model saw.
    status, tokens = post_json(server.base_url, "/tokenize", {"messages": conversation, "tools": [WEATHER_TOOL]})
    status, text = post_json(server.base_url, "/detokenize", {"tokens": tokens["tokens"]})
    assert '"name": "get_weather"' in text["prompt"] and "<tool_response>\nsunny, 24 degrees" in text["prompt"]


def test_required_tool_calls_stream_reassembles_to_the_same_calls(client: openai.OpenAI) -> None:
    kwargs = dict(model=NAME, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                  max_tokens=96, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert expected and whole.choices[0].finish_reason == "tool_calls"
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or "" if delta.function else ""
            call["arguments"] += delta.function.arguments or "" if delta.function else ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == expected
    assert all(c["id"] for c in calls.values()) and finish == "tool_calls"


def test_named_tool_stream_reassembles(client: openai.OpenAI) -> None:
    kwargs = dict(model=NAME, messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=48, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    arguments, names = "", ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names += delta.function.name or ""
            arguments += delta.function.arguments or ""
    assert names == "get_weather" and json.loads(arguments) == json.loads(whole.function.arguments)


def test_unknown_tool_name_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "launch"}})
    assert info.value.body["param"] == "tool_choice" and "launch" in info.value.body["message"]


# -- the rest --------------------------------------------------------------------------------------------

def test_logit_bias_forces_and_is_bounded(client: openai.OpenAI, server) -> None:
    status, tokens = post_json(server.base_url, "/tokenize", {"prompt": " Paris", "add_special_tokens": False})
    token_id = tokens["tokens"][-1]
    result = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={str(token_id): 100}, extra_body={"ignore_eos": True})
    status, ids = post_json(server.base_url, "/tokenize", {"prompt": result.choices[0].text,
                                                           "add_special_tokens": False})
    assert set(ids["tokens"]) == {token_id}
    for bias, words in (({"1": 101}, "[-100, 100]"), ({str(i): 1 for i in range(301)}, "at most 300")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=NAME, prompt="Hello", max_tokens=1, logit_bias=bias)
        assert words in info.value.body["message"]


def test_tokenize_detokenize_version_request_id_and_cors(server) -> None:
    status, tokens = post_json(server.base_url, "/tokenize", {"prompt": "Hello world!"})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    status, text = post_json(server.base_url, "/detokenize", {"tokens": tokens["tokens"]})
    assert text["prompt"] == "Hello world!"
    assert server.get_json("/version")[1]["version"]

    request = urllib.request.Request(f"{server.base_url}/v1/models", headers={"X-Request-Id": "abc-123",
                                                                              "Origin": ORIGIN})
    with urllib.request.urlopen(request) as response:
        assert response.headers["X-Request-Id"] == "abc-123"
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
    with urllib.request.urlopen(f"{server.base_url}/v1/models") as response:
        assert response.headers["X-Request-Id"] and "Access-Control-Allow-Origin" not in response.headers
    preflight = urllib.request.Request(f"{server.base_url}/v1/chat/completions", method="OPTIONS", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    with urllib.request.urlopen(preflight) as response:
        assert response.status == 204 and "POST" in response.headers["Access-Control-Allow-Methods"]


def test_prompt_logprobs_match_transformers_across_chunks_and_cache(client: openai.OpenAI, server) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is Paris. " * 40  # > 256 tokens: prefilled in two chunks
    expected = None
    for _ in range(2):  # the second time its blocks are cached: prompt logprobs must still come in full
        result = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0,
                                           extra_body={"prompt_logprobs": 2})
        entries = result.choices[0].model_extra["prompt_logprobs"]
        if expected is None:
            status, tokens = post_json(server.base_url, "/tokenize", {"prompt": prompt})
            ids = tokens["tokens"]
            model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32)
            with torch.no_grad():
                logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            expected = [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]
            assert len(ids) > 256
        assert entries[0] is None and len(entries) == len(expected) + 1
        got = [entry[str(token_id)]["logprob"] for entry, token_id in zip(entries[1:], ids[1:], strict=True)]
        assert got == pytest.approx(expected, abs=1e-3)
        assert all(len(entry) >= 2 and all(v["rank"] >= 1 for v in entry.values()) for entry in entries[1:])
