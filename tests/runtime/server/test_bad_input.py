"""Bad input gets a 4xx in OpenAI's error shape, and the server keeps serving afterwards: hand-picked cases, then
schemathesis' cases from GET /openapi.json (the number of cases goes to the test output; HPI_FUZZ_CASES sets it;
the 1,000-case campaign of bench/results/front_door.md is bench/fuzz_http.py, on a 64-token context)."""

from __future__ import annotations

import time

import pytest

from hpi_testing.http_fuzz import fuzz_cases, fuzz_openapi
from hpi_testing.server import post_json as post

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK_CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


CASES = [
    # (name, path, body, status, param or None, text the message must contain)
    ("malformed json", CHAT, b'{"model": "tiny-llama", "messages": [', 400, None, "not valid JSON"),
    ("json nested too deeply", CHAT, b"[" * 30_000 + b"]" * 30_000, 400, None, "nested too deeply"),
    ("empty body", CHAT, b"", 400, None, "empty"),
    ("body not an object", CHAT, b"[1, 2]", 400, None, "JSON object"),
    ("temperature wrong type", CHAT, {**OK_CHAT, "temperature": "hot"}, 400, "temperature", "number"),
    ("temperature out of range", CHAT, {**OK_CHAT, "temperature": 7}, 400, "temperature", "[0.0, 2.0]"),
    ("temperature NaN", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature", "finite"),
    ("top_p zero", CHAT, {**OK_CHAT, "top_p": 0}, 400, "top_p", "top_p"),
    # Integers that would overflow torch's int64 tensors must be refused here, not fail the engine step.
    ("top_k beyond int64", CHAT, {**OK_CHAT, "top_k": 10**20}, 400, "top_k", "'top_k'"),
    ("top_k 1e20 as float", CHAT, {**OK_CHAT, "top_k": 1e20}, 400, "top_k", "'top_k'"),
    ("seed beyond int64", CHAT, {**OK_CHAT, "seed": 2**64}, 400, "seed", "'seed'"),
    ("max_tokens beyond int64", CHAT, {**OK_CHAT, "max_tokens": 2**64}, 400, "max_tokens", "max_tokens"),
    ("min_tokens beyond int64", CHAT, {**OK_CHAT, "min_tokens": 2**64}, 400, "min_tokens", "'min_tokens'"),
    ("stop_token_ids beyond int64", CHAT, {**OK_CHAT, "stop_token_ids": [2**64], "min_tokens": 1}, 400,
     "stop_token_ids", "token ids"),
    ("stop_token_ids outside the vocabulary", CHAT, {**OK_CHAT, "stop_token_ids": [10**7], "min_tokens": 1}, 400,
     "stop_token_ids", "vocabulary"),
    ("max_tokens zero", CHAT, {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("max_tokens bool", CHAT, {**OK_CHAT, "max_tokens": True}, 400, "max_tokens", "integer"),
    ("n too large", CHAT, {**OK_CHAT, "n": 1000}, 400, "n", "'n'"),
    ("messages missing", CHAT, {"model": "tiny-llama"}, 400, "messages", "messages"),
    ("messages empty", CHAT, {**OK_CHAT, "messages": []}, 400, "messages", "non-empty"),
    ("bad role", CHAT, {**OK_CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]", "role"),
    ("image part without a url", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0]", "'url' string"),
    ("image to a text-only model", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "messages", "text-only model"),
    ("unknown content part", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     400, "messages[0]", "content parts must be 'text'"),
    ("stop wrong type", CHAT, {**OK_CHAT, "stop": 5}, 400, "stop", "stop"),
    ("priority wrong type", CHAT, {**OK_CHAT, "priority": "high"}, 400, "priority", "integer"),
    ("stream_options without stream", CHAT, {**OK_CHAT, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream"),
    ("top_logprobs without logprobs", CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("logit_bias outside the vocabulary", CHAT, {**OK_CHAT, "logit_bias": {"10000000": 5}}, 400, "logit_bias",
     "vocabulary"),
    ("logit_bias key not a token id", CHAT, {**OK_CHAT, "logit_bias": {"Paris": 5}}, 400, "logit_bias", "token ids"),
    ("response_format unknown type", CHAT, {**OK_CHAT, "response_format": {"type": "yaml"}}, 400, "response_format",
     "json_schema"),
    ("tools not a list", CHAT, {**OK_CHAT, "tools": {"name": "f"}}, 400, "tools", "list"),
    ("tool_choice required without tools", CHAT, {**OK_CHAT, "tool_choice": "required"}, 400, "tool_choice",
     "needs 'tools'"),
    ("tool_choice auto without a parser", CHAT, {**OK_CHAT, "tools": [TOOL]}, 400, "tool_choice",
     "--tool-call-parser"),
    ("tool message without tool_call_id", CHAT, {**OK_CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0]", "tool_call_id"),
    ("tool call arguments not JSON", CHAT, {**OK_CHAT, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400, "messages[0]",
     "not valid JSON"),
    ("unknown model", CHAT, {**OK_CHAT, "model": "gpt-9"}, 404, "model", "gpt-9"),
    ("prompt missing", COMPLETIONS, {"model": "tiny-llama"}, 400, "prompt", "prompt"),
    ("prompt ids out of vocabulary", COMPLETIONS, {"prompt": [1, 2, 10**7]}, 400, "prompt", "vocabulary"),
    ("prompt too long", COMPLETIONS, {"prompt": [5] * 300}, 400, "prompt",
     "maximum context length is 256 tokens, but the prompt has 300 tokens"),
    ("chat prompt too long", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "hi " * 300}]}, 400,
     "messages", "maximum context length is 256 tokens"),
    # Past LONG_PROMPT_CHARS the tokenizer runs in a thread; its errors still come back as 400s.
    ("long text prompt too long", COMPLETIONS, {"prompt": "hi " * 7000}, 400, "prompt", "maximum context length"),
    ("long chat prompt too long", CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "hi " * 7000}]}, 400,
     "messages", "maximum context length is 256 tokens"),
    ("prompt plus max_tokens too long", COMPLETIONS, {"prompt": [5] * 200, "max_tokens": 100}, 400, "max_tokens",
     "maximum context length is 256 tokens. However, you requested 300 tokens"),
    ("logprobs too many", COMPLETIONS, {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("body too large", COMPLETIONS, {"prompt": "x" * 100_000}, 413, None, "larger than"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param", "text"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_error(server, name, path, body, status, param, text) -> None:
    code, payload = post(server.base_url, path, body)
    assert code == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert text in error["message"]
    if param is not None:
        assert error["param"] == param
    assert error["type"] == ("invalid_request_error" if status in (400, 413) else "not_found_error")


def test_unknown_route_and_method_are_openai_shaped(server) -> None:
    status, payload = server.get_json("/v1/nothing-here")
    assert status == 404 and "error" in payload
    status, payload = server.get_json("/v1/completions")
    assert status == 405 and "error" in payload


def test_server_keeps_serving_after_bad_input(server) -> None:
    for _, path, body, *_ in CASES:
        post(server.base_url, path, body)
    status, payload = post(server.base_url, CHAT, OK_CHAT)
    assert status == 200, payload
    assert payload["choices"][0]["message"]["role"] == "assistant"
    assert server.process.poll() is None


GREEDY = {**OK_CHAT, "max_tokens": 8, "temperature": 0}
# /sleep takes the replica out of service by design (503s until /wake_up); test_sleep.py covers it.
NOT_FUZZED = ("/sleep",)


def test_schemathesis_finds_no_server_error(server, record_property) -> None:
    status, reference = post(server.base_url, CHAT, GREEDY)
    assert status == 200, reference

    report = fuzz_openapi(server.base_url, fuzz_cases(), exclude_paths=NOT_FUZZED, progress=server.tokens_processed)
    record_property("fuzz", report.summary())

    assert report.num_cases >= fuzz_cases() // 2, report.summary()
    assert not report.failures, "\n".join(report.failures)
    # Afterwards: ready, the same greedy answer, and nothing left running or waiting in the engine.
    assert server.get_json("/ready")[0] == 200
    status, again = post(server.base_url, CHAT, GREEDY)
    assert status == 200 and again["choices"][0]["message"] == reference["choices"][0]["message"]
    deadline = time.monotonic() + 30
    while (samples := server.metric_samples())["vllm:num_requests_running"] or samples["vllm:num_requests_waiting"]:
        assert time.monotonic() < deadline, "requests still in the engine 30 s after the fuzz ended"
        time.sleep(0.2)
