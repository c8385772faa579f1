"""The request bodies of the OpenAI endpoints, declared once: every field's type, bounds, default and meaning.

The runtime's parser (hpi_runtime.server.protocol) reads each field through its declaration here (a scalar's
type check, bounds and default come from it; a structured field is parsed by its own function, its shape
declared here), and may read no field that is not declared (an internal invariant it asserts). The runtime's
and the router's `GET /openapi.json` (openapi.py) are generated from the same declarations, so the document
and the parser cannot drift apart. Dependency-free, like the rest of hpi_contracts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
# Integers that reach torch must fit its int64 tensors; past these bounds a value can only be a mistake.
MAX_INT64 = 2**63 - 1
MAX_TOP_K = 2**31 - 1  # any top_k at or above the vocabulary size already means "off"
MAX_PRIORITY = 2**31 - 1
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_TOOLS = 128
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SCALAR_KINDS = ("integer", "number", "boolean", "string")


@dataclass(frozen=True)
class Field:
    """One body field. `kind` is a JSON type the parser checks itself (SCALAR_KINDS, with `lo`/`hi` bounds and a
    `default` for null or absent), or "json": a structured value whose parser is its own function and whose JSON
    schema is `shape`. Every field may be null (meaning "not sent") unless its body lists it as required."""

    name: str
    kind: str
    description: str
    default: Any = None
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # (lo, hi] instead of [lo, hi]
    shape: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.kind in (*SCALAR_KINDS, "json"), self.kind

    def schema(self, *, nullable: bool = True) -> dict[str, Any]:
        if self.kind == "json":
            schema: dict[str, Any] = {"anyOf": [dict(self.shape), {"type": "null"}]} if nullable else dict(self.shape)
        else:
            schema = {"type": [self.kind, "null"] if nullable else self.kind}
            if self.lo is not None:
                schema["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
            if self.hi is not None:
                schema["maximum"] = self.hi
        if self.default is not None:
            schema["default"] = self.default
        return {**schema, "description": self.description}


@dataclass(frozen=True)
class RequestBody:
    """A JSON object body: its fields by name, which of them must be sent, and the name of its schema."""

    name: str
    fields: tuple[Field, ...]
    required: tuple[str, ...] = ()

    def field(self, name: str) -> Field:
        for candidate in self.fields:
            if candidate.name == name:
                return candidate
        raise AssertionError(f"{self.name} declares no field {name!r}: declare it in hpi_contracts.openai_requests")

    def schema(self) -> dict[str, Any]:
        properties = {f.name: f.schema(nullable=f.name not in self.required) for f in self.fields}
        # Unknown fields are ignored, as OpenAI does.
        return {"type": "object", "properties": properties, "required": list(self.required),
                "additionalProperties": True}


def _integer(name: str, description: str, lo: int, hi: int, default: int | None = None) -> Field:
    return Field(name, "integer", description, default, lo, hi)


def _number(name: str, description: str, lo: float, hi: float, default: float | None = None,
            lo_open: bool = False) -> Field:
    return Field(name, "number", description, default, lo, hi, lo_open)


def _boolean(name: str, description: str, default: bool) -> Field:
    return Field(name, "boolean", description, default)


def _json(name: str, description: str, shape: Mapping[str, Any]) -> Field:
    return Field(name, "json", description, shape=shape)


TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_INT64}}
STRING_LIST = {"type": "array", "items": {"type": "string"}, "minItems": 1}
OBJECT = {"type": "object"}
NOT_SUPPORTED = "Not supported by this server: a value other than null or empty is refused with a 400."

SAMPLING: tuple[Field, ...] = (
    Field("model", "string", "The served model's name (see /v1/models); any other name is a 404."),
    _integer("max_tokens", "Most tokens to generate (default: up to the context length).", 1, MAX_INT64),
    _number("temperature", "Sampling temperature; 0 is greedy (default: the model's generation_config).", 0.0, 2.0),
    _number("top_p", "Nucleus sampling mass.", 0.0, 1.0, lo_open=True),
    _integer("top_k", "Sample among the k most likely tokens; -1 or 0 is off (vLLM's extra).", -1, MAX_TOP_K),
    _number("min_p", "Drop tokens below this fraction of the top token's probability (vLLM's extra).", 0.0, 1.0),
    _integer("seed", "Seed for this request's sampling.", -MAX_INT64 - 1, MAX_INT64),
    _json("stop", "Up to 16 strings that end the generation.",
          {"anyOf": [{"type": "string"},
                     {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS}]}),
    _json("stop_token_ids", "Token ids that end the generation (vLLM's extra).", TOKEN_IDS),
    _number("presence_penalty", "OpenAI's presence penalty.", -2.0, 2.0, 0.0),
    _number("frequency_penalty", "OpenAI's frequency penalty.", -2.0, 2.0, 0.0),
    _number("repetition_penalty", "Multiplicative repetition penalty (vLLM's extra).", 0.01, 10.0),
    _boolean("ignore_eos", "Keep generating past the end-of-sequence token (vLLM's extra).", False),
    _integer("min_tokens", "Fewest tokens to generate before a stop may end it (vLLM's extra).", 0, MAX_INT64, 0),
    _integer("priority", "Scheduling priority, lower first (vLLM's extra; the router sets it from the tenant's key).",
             -MAX_PRIORITY, MAX_PRIORITY, 0),
    _json("logit_bias", "Token id (as a string) -> bias added to its logit, at most 300 entries.",
          {"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES, "propertyNames": {"pattern": "^[0-9]+$"},
           "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}}),
    _json("response_format", "Structured output: text, json_object, or json_schema with a schema.",
          {"type": "object", "required": ["type"], "properties": {
              "type": {"enum": ["text", "json_object", "json_schema"]},
              "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": OBJECT,
                                                               "strict": {"type": ["boolean", "null"]}}}}}),
    _json("guided_json", "A JSON schema the output must match (vLLM's extra), as an object or a string.",
          {"anyOf": [OBJECT, {"type": "string"}]}),
    _json("guided_regex", "A regular expression the output must match (vLLM's extra).", {"type": "string"}),
    _json("guided_choice", "The output is one of these strings (vLLM's extra).",
          {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}),
    _json("guided_grammar", "A grammar (EBNF) the output must match (vLLM's extra).", {"type": "string"}),
    _boolean("skip_special_tokens", "Leave special tokens out of the text (vLLM's extra).", True),
    _integer("prompt_logprobs", "Logprobs of the prompt tokens with this many alternatives (vLLM's extra).",
             0, MAX_LOGPROBS),
    _integer("n", "Choices to generate.", 1, MAX_N, 1),
    _boolean("stream", "Answer with server-sent events ending in `data: [DONE]`.", False),
    _json("stream_options", "With stream: include_usage adds a final chunk with the usage.",
          {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
    _json("suffix", NOT_SUPPORTED, {}),
    _json("functions", NOT_SUPPORTED, {}),
    _json("function_call", NOT_SUPPORTED, {}),
)

TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
IMAGE_PART = {"type": "object", "required": ["type", "image_url"], "properties": {
    "type": {"const": "image_url"},
    "image_url": {"type": "object", "required": ["url"], "properties": {
        "url": {"type": "string", "description": "data:image/...;base64,..., or an http(s)/file URL the server allows"},
        "detail": {"enum": ["auto", "low", "high"]}}}},
    "description": "An image (vision-language models only; a text-only model answers 400)."}
TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"anyOf": [{"type": "string"}, OBJECT]}}}}}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": list(CHAT_ROLES)},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [TEXT_PART, IMAGE_PART]}},
                          {"type": "null"}]},
    "name": {"type": "string"},
    "tool_call_id": {"type": "string", "description": "Required in a 'tool' message."},
    "tool_calls": {"type": "array", "items": TOOL_CALL}}}
NAMED_TOOL = {"type": "object", "required": ["function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
TOOL = {"type": "object", "required": ["function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": "string"}, "parameters": OBJECT}}}}

COMPLETION = RequestBody("CompletionRequest", (
    *SAMPLING,
    _json("prompt", "A string, a list of strings, a list of token ids or a list of token-id lists.",
          {"anyOf": [{"type": "string"}, STRING_LIST, {**TOKEN_IDS, "minItems": 1},
                     {"type": "array", "items": {**TOKEN_IDS, "minItems": 1}, "minItems": 1}]}),
    _integer("logprobs", "Logprobs of each chosen token plus this many alternatives.", 0, MAX_LOGPROBS),
    _integer("best_of", "Must equal n when sent.", 1, MAX_N),
    _boolean("echo", "Put the prompt in front of the completion.", False),
), required=("prompt",))

CHAT = RequestBody("ChatCompletionRequest", (
    *SAMPLING,
    _json("messages", "The conversation, rendered with the model's chat template.",
          {"type": "array", "items": MESSAGE, "minItems": 1}),
    _integer("max_completion_tokens", "OpenAI's newer name for max_tokens (wins when both are sent).", 1, MAX_INT64),
    _boolean("logprobs", "Return the logprobs of the chosen tokens.", False),
    _integer("top_logprobs", "Alternatives per token with logprobs (needs logprobs: true).", 0, MAX_LOGPROBS),
    _json("chat_template_kwargs", "Extra variables for the chat template (vLLM's extra).", OBJECT),
    _json("tools", "Functions the model may call, at most 128.",
          {"type": "array", "items": TOOL, "maxItems": MAX_TOOLS}),
    _json("tool_choice", "none, auto, required, or a named function.",
          {"anyOf": [{"enum": ["none", "auto", "required"]}, NAMED_TOOL]}),
    _boolean("parallel_tool_calls", "Allow more than one call in an answer.", True),
), required=("messages",))

TOKENIZE = RequestBody("TokenizeRequest", (
    Field("model", "string", "The served model's name."),
    Field("prompt", "string", "The text to tokenize (or send messages)."),
    _json("messages", "A conversation rendered with the chat template, as /v1/chat/completions would.",
          {"type": "array", "items": MESSAGE, "minItems": 1}),
    _boolean("add_special_tokens", "With prompt: add the tokenizer's special tokens (BOS).", True),
    _boolean("add_generation_prompt", "With messages: end with the assistant's turn marker.", True),
    _boolean("return_token_strs", "Also return each token as a string.", False),
    *(f for f in CHAT.fields if f.name in ("tools", "chat_template_kwargs")),
))

DETOKENIZE = RequestBody("DetokenizeRequest", (
    Field("model", "string", "The served model's name."),
    _json("tokens", "The token ids to decode.", TOKEN_IDS),
), required=("tokens",))
