"""Kubernetes resource quantities ("64Gi", "3500m", "1e9") to plain numbers and back."""

from __future__ import annotations

import math
import re

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def parse_quantity(value: str | int | float) -> float:
    """A quantity as a float in base units (bytes, cores)."""
    if isinstance(value, int | float):
        return float(value)
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = match.groups()
    suffix = suffix or ""
    return float(number) * (_BINARY.get(suffix) or _DECIMAL[suffix])


def bytes_to_quantity(num_bytes: int) -> str:
    """Bytes rounded up to whole MiB, written the way kubectl users read them ("17408Mi")."""
    return f"{max(1, math.ceil(num_bytes / 2**20))}Mi"
