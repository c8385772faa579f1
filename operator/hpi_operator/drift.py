"""Whether a live child still says what the operator declares: a pure comparison, so a resync that finds
nothing to change sends nothing (server-side apply would take a no-op, but it is still a write request).

A child is in sync when the operator's declaration is unchanged since it was last applied (the spec-hash
annotation; it also covers fields the operator stopped declaring, which only an apply removes) and every
field it declares has that value live. Fields the API server or other controllers add (defaults, status,
other managers' labels) are not the operator's and never count as drift. Values compare as the API server
stores them:
- quantities by value, whether declared as a number or a string: the server stores `2` as "2", "17408Mi" as
  "17Gi", "0.5" as "500m";
- lists the server merges item by item (`x-kubernetes-list-type: map`: containers, env, ports, volumes,
  volumeMounts, ...) by their keys: every declared item must be there with its declared fields, and items
  someone else added (a hand-added env var or volume mount) are theirs, not drift, as server-side apply keeps
  them; every other list (args, tolerations, rules) is atomic and compared whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.utils import parse_quantity

from .names import ANNOTATION_SPEC_HASH

# The associative lists in the objects the operator writes, by the trailing field names of their path, with
# their x-kubernetes-list-map-keys from the Kubernetes OpenAPI (tests/operator/test_drift.py checks this table
# against the published schemas for every list the operator emits). Every other list is atomic.
MAP_LIST_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("containers", "ports"): ("containerPort", "protocol"),
    ("initContainers", "ports"): ("containerPort", "protocol"),
    ("spec", "ports"): ("port", "protocol"),  # a Service's
    ("containers",): ("name",),
    ("initContainers",): ("name",),
    ("env",): ("name",),
    ("volumeMounts",): ("mountPath",),
    ("volumes",): ("name",),
    ("imagePullSecrets",): ("name",),
    ("topologySpreadConstraints",): ("topologyKey", "whenUnsatisfiable"),
    ("ownerReferences",): ("uid",),
}
# Key fields the API server defaults before it matches items (ContainerPort and ServicePort: TCP).
KEY_DEFAULTS = {"protocol": "TCP"}


def map_list_keys(path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The item keys of the list at `path` (field names only), None for an atomic list."""
    for suffix_len in (2, 1):
        keys = MAP_LIST_KEYS.get(path[-suffix_len:])
        if keys and len(path) >= suffix_len:
            return keys
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _same_scalar(desired: Any, live: Any) -> bool:
    if desired == live:
        return True
    if isinstance(desired, str | int | float) and isinstance(live, str | int | float) and (
        isinstance(desired, str) or isinstance(live, str)
    ) and not isinstance(desired, bool) and not isinstance(live, bool):
        try:  # a quantity, either side as a string or a number
            return parse_quantity(str(desired) if _is_number(desired) else desired) == parse_quantity(
                str(live) if _is_number(live) else live
            )
        except ValueError:
            return False
    return False


def _item_key(item: Any, keys: tuple[str, ...]) -> tuple[Any, ...] | None:
    if not isinstance(item, Mapping):
        return None
    return tuple(item.get(k, KEY_DEFAULTS.get(k)) for k in keys)


def _declared_in_list(desired: list[Any], live: Any, path: tuple[str, ...]) -> bool:
    keys = map_list_keys(path)
    if keys is None:  # atomic: the whole list, in order
        if not isinstance(live, list) or len(desired) != len(live):
            return not desired and not live
        return all(declared_in(d, v, path) for d, v in zip(desired, live, strict=True))
    by_key = {_item_key(item, keys): item for item in live or []} if isinstance(live, list | type(None)) else None
    if by_key is None:
        return False
    return all(_item_key(d, keys) in by_key and declared_in(d, by_key[_item_key(d, keys)], path) for d in desired)


def declared_in(desired: Any, live: Any, path: tuple[str, ...] = ()) -> bool:
    """Every field of `desired` is in `live` with the same value (maps: a subset; associative lists: each
    declared item by its keys; atomic lists: item by item). `path`: the field names down to here."""
    if isinstance(desired, Mapping):
        if live is None:
            return not desired  # an empty map the API server does not store
        if not isinstance(live, Mapping):
            return False
        return all(declared_in(value, live.get(key), (*path, key)) for key, value in desired.items())
    if isinstance(desired, list):
        return _declared_in_list(desired, live, path)
    return _same_scalar(desired, live)


def _hash(obj: Mapping[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)


def in_sync(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """`live` carries the declaration `desired` and no one changed a field of it."""
    body = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    return _hash(desired) == _hash(live) and declared_in(body, live)
