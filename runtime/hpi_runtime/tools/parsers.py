"""Tool-call parsers per model family: completed text in, content and calls out."""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = ""


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None  # text outside the calls; None when there is none
    calls: tuple[ToolCall, ...]


def _call(item: object, arguments_key: str = "arguments") -> ToolCall | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> ToolCall, None if it is not that shape."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, item.get("parameters", item.get("arguments", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> list[object] | None:
    """Consecutive JSON values separated by whitespace, ';' or ','; None if anything else is in between."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class ToolParser:
    """Base: `start_markers` begin a tool-call section; `extract` parses a whole output."""

    name = ""
    start_markers: tuple[str, ...] = ()
    json_at_start = False  # a JSON object as the output's first non-space character is a call too
    keeps_special_tokens = False  # its markers are special tokens that detokenizing must keep

    def new_call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    @staticmethod
    def _content(text: str) -> str | None:
        return text if text.strip() else None


class HermesToolParser(ToolParser):
    """Hermes 2 Pro, Qwen 2/2.5/3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated."""

    name = "hermes"
    start_markers = ("<tool_call>",)
    _pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find("<tool_call>")
        if start < 0:
            return ExtractedToolCalls(self._content(text), ())
        calls = []
        for body in self._pattern.findall(text[start:]):
            values = _json_values(body)
            call = _call(values[0]) if values and len(values) == 1 else None
            if call is None:  # not a well-formed call: hand the text back untouched
                return ExtractedToolCalls(self._content(text), ())
            calls.append(call)
        return ExtractedToolCalls(self._content(text[:start]), tuple(calls))


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2/3.3 JSON tool calling: `{"name": ..., "parameters": {...}}` (several joined by ';'),
    optionally after `<|python_tag|>`."""

    name = "llama3_json"
    start_markers = ("<|python_tag|>",)
    json_at_start = True

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        prefix = ""
        if "<|python_tag|>" in body:
            prefix, _, body = body.partition("<|python_tag|>")
        elif not body.startswith("{"):
            return ExtractedToolCalls(self._content(text), ())
        values = _json_values(body.strip())
        calls = [_call(v, "parameters") for v in values] if values else []
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(self._content(text), ())
        return ExtractedToolCalls(self._content(prefix), tuple(calls))


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3 tokenizers) or
    `[TOOL_CALLS]name[ARGS]{...}` repeated (v11+). Mistral's templates want 9-character alphanumeric ids."""

    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True
    _alphabet = string.ascii_letters + string.digits

    def new_call_id(self) -> str:
        return "".join(secrets.choice(self._alphabet) for _ in range(9))

    def extract(self, text: str) -> ExtractedToolCalls:
        content, marker, rest = text.partition("[TOOL_CALLS]")
        if not marker:
            return ExtractedToolCalls(self._content(text), ())
        rest = rest.strip()
        calls: list[ToolCall | None] = []
        if rest.startswith("["):
            values = _json_values(rest)
            items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
            calls = [_call(item) for item in items] if items else [None]
        else:
            for chunk in rest.split("[TOOL_CALLS]"):
                name, args_marker, arguments = chunk.partition("[ARGS]")
                values = _json_values(arguments) if args_marker else None
                valid = values is not None and len(values) == 1 and name.strip()
                calls.append(_call({"name": name.strip(), "arguments": values[0]}) if valid else None)
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(self._content(text), ())
        return ExtractedToolCalls(self._content(content), tuple(calls))


PARSERS = {parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
