"""Whether a live child still says what the operator declares: a pure comparison, so a resync that finds
nothing to change sends nothing (server-side apply would take a no-op, but it is still a write request).

A child is in sync when the operator's declaration is unchanged since it was last applied (the spec-hash
annotation; it also covers fields the operator stopped declaring, which only an apply removes) and every
field it declares has that value live. Fields the API server or other controllers add (defaults, status,
other managers' labels) are not the operator's and never count as drift. Quantities compare by value: the
API server stores "17408Mi" as "17Gi".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.utils import parse_quantity

from .names import ANNOTATION_SPEC_HASH


def _same_scalar(desired: Any, live: Any) -> bool:
    if desired == live:
        return True
    if isinstance(desired, str) and isinstance(live, str | int) and not isinstance(live, bool):
        try:
            return parse_quantity(desired) == parse_quantity(live)
        except ValueError:
            return False
    return False


def declared_in(desired: Any, live: Any) -> bool:
    """Every field of `desired` is in `live` with the same value (maps: a subset; lists: item by item)."""
    if isinstance(desired, Mapping):
        if live is None:
            return not desired  # an empty map the API server does not store
        if not isinstance(live, Mapping):
            return False
        return all(declared_in(value, live.get(key)) for key, value in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return not desired and not live
        return all(declared_in(d, v) for d, v in zip(desired, live, strict=True))
    return _same_scalar(desired, live)


def _hash(obj: Mapping[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)


def in_sync(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """`live` carries the declaration `desired` and no one changed a field of it."""
    body = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    return _hash(desired) == _hash(live) and declared_in(body, live)
