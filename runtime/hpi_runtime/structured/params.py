"""What a request constrains its output to, and the check that it can be compiled (the 400 path).

`StructuredOutputsParams` rides in `SamplingParams` to the engine core, which compiles it (compiler.py).
The frontend calls `check()` first, off the event loop: it parses the grammar without a tokenizer (well
under a millisecond for a typical schema), so a bad schema, regex or EBNF is a 400 that names the problem
instead of a failure inside the engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# xgrammar prefixes its errors with a timestamp and a C++ source location; clients need only the message.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (?:Check failed: .*? is false: )?")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint. `spec`: the JSON schema (as JSON text) for json, a JSON list of strings for choice,
    the pattern for regex, EBNF (GBNF-style, as vLLM's guided_grammar) for grammar, "" for json_object.
    `strict` (json only): no properties beyond the schema's unless it allows them (OpenAI's strict)."""

    kind: str
    spec: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}; got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict | str, strict: bool = True) -> StructuredOutputsParams:
        # Key order kept: properties are generated in the order the schema lists them.
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema), strict)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutputsParams:
        return cls("choice", json.dumps(list(choices)))


def choice_ebnf(spec: str) -> str:
    """EBNF for "exactly one of these strings": JSON string literals are valid EBNF literals in xgrammar."""
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec))


def clean_error(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _CPP_PREFIX.sub("", lines[0] if lines else type(exc).__name__)


def check(params: StructuredOutputsParams) -> None:
    """ValueError naming what is wrong if `params` cannot be compiled."""
    import xgrammar as xgr

    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice list",
            "grammar": "grammar"}[params.kind]
    try:
        if params.kind == "json":
            xgr.Grammar.from_json_schema(params.spec, any_whitespace=False, strict_mode=params.strict)
        elif params.kind == "regex":
            xgr.Grammar.from_regex(params.spec)
        elif params.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(params.spec))
        elif params.kind == "grammar":
            xgr.Grammar.from_ebnf(params.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid {what}: {clean_error(exc)}") from exc
