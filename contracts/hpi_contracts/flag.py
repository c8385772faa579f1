"""One `hpi serve` flag as the operator sees it: its spelling, its value's type, its default and choices.

The table of them (serve_flags.py) is generated from the runtime's config tree; serve.py renders a pod's
arguments through it."""

from __future__ import annotations

from dataclasses import dataclass

# bytes: an int, or a size such as 2GiB; switch: no value; strs: one or more strings after the flag
FLAG_TYPES = ("int", "float", "str", "bytes", "switch", "strs")


@dataclass(frozen=True)
class ServeFlag:
    name: str  # the spelling, e.g. "--block-size"
    field: str  # the runtime's option (LLM's keyword argument), e.g. "block_size"
    type: str  # one of FLAG_TYPES
    default: int | float | str | bool | tuple[str, ...] | None  # the runtime's default when the flag is absent
    choices: tuple[int | float | str, ...] = ()  # empty: any value of `type`
