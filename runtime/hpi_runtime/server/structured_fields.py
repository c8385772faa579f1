"""Request fields for structured outputs and logit bias: response_format, vLLM's guided_*, logit_bias."""

from __future__ import annotations

import json
import math
from typing import Any

from hpi_contracts.openai_requests import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES
from hpi_runtime.server.errors import bad_request
from hpi_runtime.structured.params import StructuredOutputsParams

MAX_TOKEN_ID = 2**63 - 1
# vLLM's extra request fields for structured outputs, and the kind each one asks for.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, at most 300 entries."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"'logit_bias' takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}",
                          "logit_bias")
    pairs = []
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if token_id < 0 or token_id > MAX_TOKEN_ID:
            raise bad_request(f"'logit_bias' keys must be non-negative token ids, got {key!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise bad_request(f"'logit_bias' values must be numbers, got {bias!r}", "logit_bias")
        if abs(bias) > MAX_LOGIT_BIAS:
            raise bad_request(f"'logit_bias' values must be in [-100, 100], got {bias}", "logit_bias")
        pairs.append((token_id, float(bias)))
    return tuple(sorted(pairs))


def parse_structured(body) -> StructuredOutputsParams | None:
    """response_format (OpenAI) or one of vLLM's guided_* fields; at most one constraint per request."""
    found = [name for name in ("response_format", *GUIDED_FIELDS) if body.get(name) not in (None, "")]
    found = [name for name in found if not (name == "response_format" and _is_text(body.get(name)))]
    if len(found) > 1:
        raise bad_request(f"send at most one of {', '.join(found)}", found[1])
    if not found:
        return None
    name, value = found[0], body.get(found[0])
    if name == "response_format":
        return _response_format(value)
    kind = GUIDED_FIELDS[name]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"'guided_json' is not valid JSON: {exc}", name) from exc
        if not isinstance(value, dict):
            raise bad_request("'guided_json' must be a JSON schema (an object)", name)
        return StructuredOutputsParams.json_schema(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request("'guided_choice' must be a non-empty list of non-empty strings", name)
        return StructuredOutputsParams.choice(value)
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", name)
    return StructuredOutputsParams(kind, value)


def _response_format(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", "response_format")
    kind = value["type"]
    if kind == "json_object":
        return StructuredOutputsParams("json_object")
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be text, json_object or json_schema; got {kind!r}",
                          "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object with a 'schema'", "response_format")
    schema = spec.get("schema", {})  # OpenAI allows leaving it out: any JSON object
    if not isinstance(schema, dict):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'response_format.json_schema.strict' must be a boolean", "response_format")
    return StructuredOutputsParams.json_schema(schema or {"type": "object"}, strict=strict is not False)


def _is_text(response_format: Any) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") == "text"
