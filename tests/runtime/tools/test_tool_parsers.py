"""Tool-call parsers on recorded model outputs of each family, whole and streamed in small pieces."""

from __future__ import annotations

import json

import pytest

from hpi_runtime.tools.parsers import get_tool_parser
from hpi_runtime.tools.stream import ToolCallStream

WEATHER = {"city": "Paris", "unit": "c"}
# (parser, recorded output, expected content, expected calls as (name, arguments))
RECORDED = [
    # Qwen2.5-7B-Instruct, two parallel calls after a sentence.
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    # Hermes-2-Pro: a call alone, closing tag cut by the end of the output.
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n',
     None, [("get_weather", WEATHER)]),
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    # Llama-3.1-8B-Instruct JSON tool calling, with and without the python tag; two calls joined by ';'.
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
     '{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
     [("get_weather", WEATHER), ("get_time", {"zone": "UTC"})]),
    ("llama3_json", "It is sunny in {Paris}.", "It is sunny in {Paris}.", []),
    # Mistral-7B-Instruct-v0.3 (a JSON list) and Mistral-Small-2501 (v11 tokenizer: name[ARGS]{...}).
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', None,
     [("get_weather", WEATHER)]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]get_time[ARGS]'
     '{"zone": "CET"}', "Sure. ", [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    ("mistral", "No tools needed.", "No tools needed.", []),
]


def _calls(extracted) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in extracted.calls]


@pytest.mark.parametrize("parser_name, text, content, calls", RECORDED)
def test_parser_extracts_recorded_output(parser_name, text, content, calls) -> None:
    extracted = get_tool_parser(parser_name).extract(text)
    assert _calls(extracted) == calls
    assert extracted.content == content


@pytest.mark.parametrize("parser_name, text, content, calls", RECORDED)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_pieces_give_the_same_calls_and_no_markup_in_content(parser_name, text, content, calls,
                                                                      piece) -> None:
    parser = get_tool_parser(parser_name)
    stream = ToolCallStream(parser)
    streamed = "".join(stream.feed(text[i: i + piece]) for i in range(0, len(text), piece))
    extracted = stream.finish()
    assert _calls(extracted) == calls
    streamed += extracted.content or ""
    assert streamed == (content or "") if calls else streamed == text
    if calls:
        assert not any(marker[:2] in streamed for marker in parser.start_markers if marker[:2] != "<|")


def test_mistral_ids_are_nine_alphanumerics_and_unknown_parser_is_named() -> None:
    call_id = get_tool_parser("mistral").new_call_id()
    assert len(call_id) == 9 and call_id.isalnum()
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("gpt")
