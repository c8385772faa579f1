"""How a configuration option is declared once and rendered everywhere it appears.

An option is a dataclass field made by `option(default, help, ...)`: its default, help text and command-line
spelling travel in the field's metadata, so `hpi serve`'s argparse flags, `LLM(...)`'s keyword arguments and
the operator's flag contract are all read off the same field (see config.py, the tree of sections). Nothing
here imports torch: `hpi serve --help` and the contract generator stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_META_KEY = "hpi_option"


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000000)")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


@dataclass(frozen=True)
class OptionInfo:
    """What a field's metadata says about it beyond its name, type and default."""

    help: str
    flag: str | None = None  # the CLI spelling when it is not --<name-with-dashes> (kept from earlier releases)
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    parse: Callable[[str], Any] | None = None  # argparse `type=` when the field's type is not enough (sizes)
    multiple: bool = False  # one or more values after the flag (argparse nargs="+"); the field holds a tuple


def option(default: Any, help: str, *, flag: str | None = None, aliases: Sequence[str] = (),
           choices: Sequence[Any] | None = None, parse: Callable[[str], Any] | None = None,
           multiple: bool = False) -> Any:  # fmt: skip
    """A dataclass field that is a user-facing option (`multiple`: a tuple of values, `--flag A B ...`)."""
    info = OptionInfo(help, flag, tuple(aliases), None if choices is None else tuple(choices), parse, multiple)
    return dataclasses.field(default=default, metadata={_META_KEY: info})


@dataclass(frozen=True)
class OptionSpec:
    """One option as every renderer sees it."""

    name: str  # the field name: LLM's keyword argument and argparse's dest
    section: str  # the section's name (argparse group)
    type: type  # int, float, str or bool (None removed from `X | None`; of each value for a `multiple` option)
    default: Any
    info: OptionInfo

    @property
    def flag(self) -> str:
        if self.info.flag is not None:
            return self.info.flag
        return "--" + self.name.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        """A bool: a flag without a value (--enforce-eager sets True; --no-prefix-caching sets False)."""
        return self.type is bool


def option_specs(section_cls: type, section: str) -> list[OptionSpec]:
    """The option fields of one section dataclass, in declaration order."""
    hints = typing.get_type_hints(section_cls)
    specs = []
    for f in dataclasses.fields(section_cls):
        info = f.metadata.get(_META_KEY)
        if info is None:
            continue
        specs.append(OptionSpec(f.name, section, _base_type(hints[f.name], info.multiple), f.default, info))
    return specs


def _base_type(hint: Any, multiple: bool = False) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    if multiple:  # tuple[X, ...]
        if typing.get_origin(base) is not tuple:
            raise TypeError(f"a multiple option must be a tuple[X, ...], got {hint!r}")
        base = typing.get_args(base)[0]
    if base not in (int, float, str, bool):
        raise TypeError(f"options must be int, float, str or bool (or None), got {hint!r}")
    return base


def check_choices(section: object) -> None:
    """ValueError when an option of `section` (a section dataclass) is outside its choices."""
    for f in dataclasses.fields(section):
        info = f.metadata.get(_META_KEY)
        value = getattr(section, f.name)
        if info is not None and info.choices is not None and value is not None and value not in info.choices:
            allowed = ", ".join(repr(c) for c in info.choices)
            raise ValueError(f"{f.name} must be one of {allowed}; got {value!r}")


def add_flags(group: argparse._ActionsContainer, specs: Sequence[OptionSpec]) -> None:
    """One argparse argument per option; the namespace attribute is the field name."""
    for spec in specs:
        names = [spec.flag, *spec.info.aliases]
        help_text = spec.info.help.replace("%", "%%")
        if spec.is_switch:
            # A switch names the non-default side: --enforce-eager (default off), --no-prefix-caching (default on).
            if spec.default:
                help_text += f" ({spec.name} is %(default)s without it)"
            action = "store_false" if spec.default else "store_true"
            group.add_argument(*names, dest=spec.name, action=action, default=spec.default, help=help_text)
            continue
        metavar = None if spec.info.choices else spec.flag.lstrip("-").replace("-", "_").upper()
        group.add_argument(*names, dest=spec.name, type=spec.info.parse or spec.type, default=spec.default,
                           choices=spec.info.choices, metavar=metavar, help=help_text,
                           nargs="+" if spec.info.multiple else None)  # fmt: skip
