"""Tool calling in the chat endpoint: what the template renders, what the grammar enforces, what is parsed.

- `none`: the tools are not rendered and nothing is parsed.
- `auto`: the model's own chat template renders the tools; its output is parsed by the family's parser
  (`--tool-call-parser`), and text that is not a call stays content.
- `required` and a named function: the grammar engine constrains the output (as vLLM does) to a JSON list of
  {"name", "parameters"} calls or to the named function's arguments, so the result is always a valid call,
  whatever the model's family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from hpi_runtime.server.errors import bad_request
from hpi_runtime.server.protocol import ChatRequest
from hpi_runtime.structured.params import StructuredOutputsParams
from hpi_runtime.tools.parsers import ExtractedToolCalls, ToolCall, ToolParser, get_tool_parser


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required", "named"
    tools: tuple[dict[str, Any], ...]  # rendered into the prompt (empty: none)
    parser: ToolParser | None  # auto only
    named: str | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"


def plan_tools(body: ChatRequest, parser_name: str | None) -> tuple[ToolPlan, ChatRequest]:
    """The plan for this request and the request with the grammar it needs (400 for what cannot work)."""
    choice = body.tool_choice
    if choice.mode == "none":
        return ToolPlan("none", (), None), body
    if choice.mode == "auto":
        if parser_name is None:
            raise bad_request("tool_choice 'auto' needs the server started with --tool-call-parser "
                              "(hermes, llama3_json or mistral); 'required' or a named function work without it",
                              "tool_choice")
        parser = get_tool_parser(parser_name)
        sampling = replace(body.sampling, skip_special_tokens=False) if parser.keeps_special_tokens else body.sampling
        return ToolPlan("auto", body.tools, parser), replace(body, sampling=sampling)
    if body.sampling.structured is not None:
        raise bad_request("tool_choice 'required' or a named function cannot be combined with response_format "
                          "or guided decoding", "tool_choice")
    functions = {tool["function"]["name"]: tool["function"] for tool in body.tools}
    if choice.mode == "named":
        schema = functions[choice.name]["parameters"]
        structured = StructuredOutputsParams.json_schema(schema)
    else:
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": f["parameters"]},
                  "required": ["name", "parameters"]} for name, f in functions.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not body.parallel_tool_calls:
            array["maxItems"] = 1
        structured = StructuredOutputsParams.json_schema(array)
    sampling = replace(body.sampling, structured=structured)
    return ToolPlan(choice.mode, body.tools, None, choice.name), replace(body, sampling=sampling)


def extract_calls(plan: ToolPlan, text: str) -> ExtractedToolCalls:
    """The calls in a finished output (and the content around them)."""
    if plan.mode == "auto":
        return plan.parser.extract(text)
    if plan.mode == "named":
        return ExtractedToolCalls(None, (ToolCall(plan.named, text),))
    try:
        items = json.loads(text)
    except ValueError:  # cut off by max_tokens: not a call
        return ExtractedToolCalls(text or None, ())
    return ExtractedToolCalls(None, tuple(ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                                          for item in items))


def new_call_id(plan: ToolPlan) -> str:
    return (plan.parser or get_tool_parser("hermes")).new_call_id()


def render_calls(plan: ToolPlan, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """OpenAI message.tool_calls."""
    return [{"id": call.id or new_call_id(plan), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]


def call_deltas(plan: ToolPlan, calls: tuple[ToolCall, ...], first_index: int) -> list[list[dict[str, Any]]]:
    """Streamed delta.tool_calls as OpenAI sends them: per call, a chunk with index, id, type and name (empty
    arguments), then one with the arguments."""
    deltas = []
    for offset, call in enumerate(calls):
        index = first_index + offset
        deltas.append([{"index": index, "id": call.id or new_call_id(plan), "type": "function",
                        "function": {"name": call.name, "arguments": ""}}])
        deltas.append([{"index": index, "function": {"arguments": call.arguments}}])
    return deltas
