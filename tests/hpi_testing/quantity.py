"""Kubernetes resource quantities in the API server's canonical form (k8s.io/apimachinery/pkg/api/resource,
quantity.go: `ParseQuantity`, `CanonicalizeBytes`), which is how a quantity is stored and read back.

- The format is the suffix's: binary SI (Ki..Ei), decimal exponent (e3), or decimal SI (n, u, m, "", k..E).
- The value is rounded away from zero to nano units (the API's smallest scale).
- Decimal forms print an integer mantissa and the largest exponent that is a multiple of 3 and keeps it
  whole: "0.5" -> "500m", "1000" -> "1k", "1500" -> "1500", "1e3" stays "1e3".
- Binary SI prints the largest power of 1024 that keeps the mantissa whole ("1024Mi" -> "1Gi",
  "1.5Gi" -> "1536Mi"); a value under 1024 or not a whole number prints as decimal SI ("0.5Ki" -> "512").
- A JSON number is read as the text of that number (`2` -> "2", `0.5` -> "500m").
"""

from __future__ import annotations

import decimal
import re
from decimal import Decimal

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exponent: suffix for suffix, exponent in _DECIMAL.items()}
_BINARY_SUFFIX = {power: suffix for suffix, power in _BINARY.items()}
_PATTERN = re.compile(r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))((?:[eE][+-]?[0-9]+)|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?$")
_CONTEXT = decimal.Context(prec=60)


class QuantityError(ValueError):
    """Not a quantity: the API server answers 400 (decoding) or 422 (validation)."""


def parse(value: str | int | float) -> tuple[Decimal, str]:
    """(value, format) of a quantity; format is BinarySI | DecimalExponent | DecimalSI."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise QuantityError(f"quantities must match the regular expression: {value!r}")
    text = value if isinstance(value, str) else repr(value)
    match = _PATTERN.match(text.strip())
    if not match:
        raise QuantityError(f"quantities must match the regular expression '{_PATTERN.pattern}': {text!r}")
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        return _CONTEXT.multiply(number, Decimal(1024) ** _BINARY[suffix]), "BinarySI"
    if suffix[:1] in ("e", "E"):
        return _CONTEXT.multiply(number, Decimal(10) ** int(suffix[1:])), "DecimalExponent"
    return _CONTEXT.multiply(number, Decimal(10) ** _DECIMAL[suffix]), "DecimalSI"


def _decimal_form(value: Decimal, format_: str) -> str:
    # Rounded away from zero to nano units, then mantissa * 10**exponent with the exponent a multiple of 3.
    nanos = int(value.scaleb(9).to_integral_value(rounding=decimal.ROUND_UP))
    mantissa, exponent = nanos, -9
    while mantissa % 10 == 0:
        mantissa //= 10
        exponent += 1
    shift = exponent % 3
    mantissa, exponent = mantissa * 10**shift, exponent - shift
    if format_ == "DecimalExponent":
        return f"{mantissa}" if exponent == 0 else f"{mantissa}e{exponent}"
    if exponent in _DECIMAL_SUFFIX:
        return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"
    return f"{mantissa}e{exponent}"


def canonical(value: str | int | float) -> str:
    """The string the API server stores for the quantity `value`."""
    number, format_ = parse(value)
    if number == 0:
        return "0"
    if format_ == "BinarySI" and (abs(number) < 1024 or number != number.to_integral_value()):
        format_ = "DecimalSI"
    if format_ != "BinarySI":
        return _decimal_form(number, format_)
    mantissa, power = int(number), 0
    while power < max(_BINARY_SUFFIX) and mantissa % 1024 == 0:
        mantissa //= 1024
        power += 1
    return f"{mantissa}{_BINARY_SUFFIX.get(power, '')}"
