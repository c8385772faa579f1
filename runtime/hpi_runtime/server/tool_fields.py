"""Request fields for tool calling: tools, tool_choice, and the tool_calls of assistant messages."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hpi_contracts.openai_requests import MAX_TOOLS
from hpi_runtime.server.errors import bad_request


@dataclass(frozen=True)
class ToolChoice:
    """tool_choice, normalised: mode "none", "auto", "required" or "named" (then `name` is the function)."""

    mode: str
    name: str | None = None


def parse_tools(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    tools, names = [], set()
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"{param} must be an object of type 'function'", param)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"{param}.function must be an object with a 'name'", param)
        if function["name"] in names:
            raise bad_request(f"{param}: the function name {function['name']!r} is used twice", param)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"{param}.function.parameters must be a JSON schema object", param)
        names.add(function["name"])
        tools.append({"type": "function", "function": {**function, "parameters": parameters}})
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[dict[str, Any], ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and isinstance(value.get("function"), dict) and isinstance(
        value["function"].get("name"), str
    ):
        choice = ToolChoice("named", value["function"]["name"])
    else:
        raise bad_request("'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    if choice.mode != "none" and not tools:
        raise bad_request(f"'tool_choice' {value if isinstance(value, str) else 'named'} needs 'tools'",
                          "tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if choice.mode == "named" and choice.name not in names:
        raise bad_request(f"'tool_choice' names the function {choice.name!r}, which is not among the tools "
                          f"({', '.join(names)})", "tool_choice")
    return choice


def parse_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, with arguments decoded from JSON: chat templates (Qwen's, Llama's,
    Mistral's) render them with `tojson`, as transformers documents."""
    if not isinstance(value, list):
        raise bad_request(f"{param}.tool_calls must be a list", param)
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{param}.tool_calls entries need a function with a name", param)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as exc:
                raise bad_request(f"{param}.tool_calls: arguments are not valid JSON: {exc}", param) from exc
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls
