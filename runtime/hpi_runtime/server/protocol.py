"""Parse and validate OpenAI request bodies into plain frozen dataclasses, or raise a 400 ApiError.

Every field is read through its declaration in hpi_contracts.openai_requests (type, bounds, default), the same
declarations GET /openapi.json is generated from. Unknown fields are ignored, as OpenAI does. Known fields are
type-checked strictly (a JSON `true` is not an integer, a string is not a number) so that a typo is a clear 400
and never a 500 deeper down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hpi_contracts.openai_requests import CHAT, CHAT_ROLES, COMPLETION, MAX_INT64, MAX_STOP_STRINGS, RequestBody
from hpi_runtime.server.errors import bad_request
from hpi_runtime.server.structured_fields import parse_logit_bias, parse_structured
from hpi_runtime.server.tool_fields import ToolChoice, parse_tool_calls, parse_tool_choice, parse_tools
from hpi_runtime.structured.params import StructuredOutputsParams


@dataclass(frozen=True)
class SamplingFields:
    """The sampling settings common to both endpoints; max_tokens is resolved later against the prompt.
    None in temperature/top_p/top_k/min_p/repetition_penalty means "not sent": the model's
    generation_config.json default applies, else SamplingParams' own (as vLLM's --generation-config auto)."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float | None
    ignore_eos: bool
    min_tokens: int
    logprobs: int | None  # None: no logprobs; k: chosen token plus top-k alternatives
    priority: int = 0  # vLLM's extra parameter: lower is admitted first (scheduling; rides with the settings)
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutputsParams | None = None  # response_format or vLLM's guided_* fields
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's extra: logprobs of the prompt tokens, top-n alternatives


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: SamplingFields
    n: int
    stream: bool
    include_usage: bool
    echo: bool


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict[str, Any], ...]
    sampling: SamplingFields
    n: int
    stream: bool
    include_usage: bool
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI's {"type": "function", "function": {...}} entries
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    # OpenAI's image_url parts, in the order they appear; each stands in its message's content as {"type": "image"}
    image_urls: tuple[str, ...] = ()


class Body:
    """Typed access to a JSON object's declared fields with OpenAI-style 400s naming the parameter: a scalar's
    type, bounds and default come from its declaration; `get` hands a structured field to its own parser."""

    def __init__(self, body: Any, declared: RequestBody):
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self.body = body
        self.declared = declared

    def _value(self, name: str, kind: str) -> tuple[Any, Any]:
        declaration = self.declared.field(name)
        assert declaration.kind == kind, f"{name} is declared {declaration.kind}, read as {kind}"
        return self.body.get(name), declaration

    def get(self, name: str) -> Any:
        return self._value(name, "json")[0]

    def integer(self, name: str) -> int | None:
        value, declared = self._value(name, "integer")
        lo, hi = declared.lo, declared.hi
        if value is None:
            return declared.default
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise bad_request(f"'{name}' must be an integer, got {type(value).__name__}", name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise bad_request(f"'{name}' must be in [{lo}, {hi}], got {value}", name)
        return value

    def number(self, name: str) -> float | None:
        value, declared = self._value(name, "number")
        lo, hi, lo_open = declared.lo, declared.hi, declared.lo_open
        if value is None:
            return declared.default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request(f"'{name}' must be a number, got {type(value).__name__}", name)
        if not math.isfinite(value):  # Python's json accepts NaN and Infinity
            raise bad_request(f"'{name}' must be a finite number, got {value}", name)
        if value < lo or value > hi or (lo_open and value == lo):
            interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise bad_request(f"'{name}' must be in {interval}, got {value}", name)
        return float(value)

    def boolean(self, name: str) -> bool:
        value, declared = self._value(name, "boolean")
        if value is None:
            return declared.default
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be a boolean, got {type(value).__name__}", name)
        return value

    def string(self, name: str) -> str | None:
        value, _ = self._value(name, "string")
        if value is not None and not isinstance(value, str):
            raise bad_request(f"'{name}' must be a string, got {type(value).__name__}", name)
        return value

    def stop(self) -> tuple[str, ...]:
        value = self.get("stop")
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise bad_request("'stop' must be a string or a list of strings", "stop")
        if len(value) > MAX_STOP_STRINGS:
            raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
        return tuple(s for s in value if s)

    def token_ids(self, name: str) -> tuple[int, ...]:
        value = self.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(_is_int(t) and 0 <= t <= MAX_INT64 for t in value):
            raise bad_request(f"'{name}' must be a list of non-negative integers (token ids)", name)
        return tuple(value)

    def stream_options(self, stream: bool) -> bool:
        options = self.get("stream_options")
        if options is None:
            return False
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        include = options.get("include_usage", False)
        if not isinstance(include, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
        return include


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampling(body: Body, logprobs: int | None, *, max_tokens_field: str = "max_tokens") -> SamplingFields:
    for unsupported in ("suffix", "functions", "function_call"):
        value = body.get(unsupported)
        if value not in (None, {}, [], ""):
            raise bad_request(f"'{unsupported}' is not supported by this server", unsupported)
    max_tokens = body.integer(max_tokens_field)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = body.integer("max_tokens")
    return SamplingFields(
        max_tokens=max_tokens,
        temperature=body.number("temperature"),
        top_p=body.number("top_p"),
        top_k=body.integer("top_k"),
        min_p=body.number("min_p"),
        seed=body.integer("seed"),
        stop=body.stop(),
        stop_token_ids=body.token_ids("stop_token_ids"),
        presence_penalty=body.number("presence_penalty"),
        frequency_penalty=body.number("frequency_penalty"),
        repetition_penalty=body.number("repetition_penalty"),
        ignore_eos=body.boolean("ignore_eos"),
        min_tokens=body.integer("min_tokens"),
        logprobs=logprobs,
        priority=body.integer("priority"),
        logit_bias=parse_logit_bias(body.get("logit_bias")),
        structured=parse_structured(body),
        skip_special_tokens=body.boolean("skip_special_tokens"),
        prompt_logprobs=body.integer("prompt_logprobs"),
    )


def parse_completion(raw: Any) -> CompletionRequest:
    body = Body(raw, COMPLETION)
    prompt = body.get("prompt")
    prompts: list[str | tuple[int, ...]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [tuple(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        prompts = [tuple(p) for p in prompt]
    else:
        raise bad_request(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
            "prompt",
        )
    if any(isinstance(p, tuple) and min(p) < 0 for p in prompts):
        raise bad_request("token ids in 'prompt' must be non-negative", "prompt")
    stream = body.boolean("stream")
    n = body.integer("n")
    best_of = body.integer("best_of")
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' different from 'n' is not supported", "best_of")
    return CompletionRequest(
        model=body.string("model"),
        prompts=tuple(prompts),
        sampling=_sampling(body, body.integer("logprobs")),
        n=n,
        stream=stream,
        include_usage=body.stream_options(stream),
        echo=body.boolean("echo"),
    )


def parse_chat(raw: Any) -> ChatRequest:
    body = Body(raw, CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    image_urls: list[str] = []
    parsed = tuple(_message(m, i, image_urls) for i, m in enumerate(messages))
    stream = body.boolean("stream")
    want_logprobs = body.boolean("logprobs")
    top_logprobs = body.integer("top_logprobs")
    if top_logprobs is not None and not want_logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    tools = parse_tools(body.get("tools"))
    return ChatRequest(
        model=body.string("model"),
        messages=parsed,
        sampling=_sampling(
            body, (top_logprobs or 0) if want_logprobs else None, max_tokens_field="max_completion_tokens"
        ),
        n=body.integer("n"),
        stream=stream,
        include_usage=body.stream_options(stream),
        chat_template_kwargs=template_kwargs,
        tools=tools,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=body.boolean("parallel_tool_calls"),
        image_urls=tuple(image_urls),
    )


def _content_parts(parts: list, param: str, image_urls: list[str]) -> str | list[dict[str, Any]]:
    """A list of content parts: their text joined into a string, or, with images, the parts as the chat
    template takes them ({"type": "text", "text"} and {"type": "image"}), each image's URL added to image_urls."""
    rendered: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            rendered.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str) or not url:
                raise bad_request(f"{param}.content[{j}].image_url must be an object with a 'url' string", param)
            image_urls.append(url)
            rendered.append({"type": "image"})
        else:
            raise bad_request(f"{param}.content[{j}]: content parts must be 'text' (with a 'text' string) or "
                              "'image_url'", param)  # fmt: skip
    if all(part["type"] == "text" for part in rendered):
        return "".join(part["text"] for part in rendered)
    return rendered


def _message(message: Any, index: int, image_urls: list[str]) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object", param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", param)
    extra: dict[str, Any] = {}
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str) or not message["tool_call_id"]:
            raise bad_request(f"{param}: a 'tool' message needs a 'tool_call_id'", param)
        extra["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            extra["name"] = message["name"]
    if role == "assistant" and message.get("tool_calls"):
        extra["tool_calls"] = parse_tool_calls(message["tool_calls"], param)
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        content = _content_parts(content, param, image_urls)
    elif not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string or a list of content parts", param)
    return {"role": "system" if role == "developer" else role, "content": content, **extra}
