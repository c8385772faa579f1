"""`hpi serve` arguments built through the flag contract: a flag the runtime does not have, or a value outside
its choices, is a ValueError when the operator renders the pod, not a crash-looping container."""

from __future__ import annotations

from collections.abc import Mapping

from hpi_contracts.serve_flags import SERVE_FLAGS


def serve_args(values: Mapping[str, object]) -> list[str]:
    """{flag: value} -> argument list, in the mapping's order. None leaves a flag out (the runtime's default);
    a switch is given for True and left out for False; a `strs` flag takes a string or a list of them (an
    empty list leaves it out)."""
    args: list[str] = []
    for name, value in values.items():
        flag = SERVE_FLAGS.get(name)
        if flag is None:
            raise ValueError(f"`hpi serve` has no flag {name}")
        if value is None or (flag.type == "switch" and value is False):
            continue
        if flag.type == "switch":
            if value is not True:
                raise ValueError(f"{name} is a switch: True or False, got {value!r}")
            args.append(name)
            continue
        if flag.type == "strs":  # one or more values: --lora-modules a=/p b=/q
            values = [value] if isinstance(value, str) else list(value)
            if not values:
                continue
            args += [name, *map(str, values)]
            continue
        if flag.choices and value not in flag.choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, flag.choices))}; got {value!r}")
        args += [name, str(value)]
    return args
