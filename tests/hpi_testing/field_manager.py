"""Server-side apply and managed fields, as the emulator does them (pure functions on plain dicts).

A field manager owns leaf fields: scalars, atomic lists taken whole, empty maps, and the items of associative
lists. Which lists are associative comes from the object's schema (k8s_openapi.py: the published OpenAPI of
built-in kinds, a CRD's structural schema for custom resources), as structured-merge-diff reads it:
- `x-kubernetes-list-type: map` lists are merged item by item, keyed by `x-kubernetes-list-map-keys`
  (containers by name, container ports by containerPort + protocol, volumeMounts by mountPath, ...); an item
  is path segment `k:{"name":"runtime"}` and each of its fields can have its own owner;
- `set` lists are merged value by value (`v:"value"`);
- `atomic` lists (tolerations, args, command) and lists the schema does not mark are one field.
A key field the configuration leaves out takes its default before items are matched (a port's protocol is
"TCP"), as the API server defaults key fields.
Ownership is recorded in `metadata.managedFields` in the API server's FieldsV1 shape
(`{"f:spec": {"f:replicas": {}}}`, `{"k:{\"name\":\"a\"}": {".": {}, "f:name": {}}}`), one entry per manager
and operation.

- An update (POST, PUT, merge, strategic merge or JSON patch) gives its manager every field whose value it
  changed and takes those fields from the managers that owned them.
- An apply sets the fields of its configuration, removes the fields (and list items) its manager applied before
  and no longer applies (unless another manager also owns them), and conflicts (409) where it would change a
  field another manager owns, unless forced: then the field changes hands. List items others added stay.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hpi_testing.k8s_openapi import Schema

Path = tuple[str, ...]
APPLY, UPDATE = "Apply", "Update"
_UNTRACKED_META = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                   "managedFields", "deletionTimestamp", "generateName", "selfLink")  # fmt: skip
_MISSING = object()


KEY_DEFAULTS = {"protocol": "TCP"}  # key fields the API server defaults (ContainerPort, ServicePort, EndpointPort)


def item_segment(item: Any, schema: Schema | None) -> str | None:
    """The path segment of a list item (`k:{...}` in a map list, `v:...` in a set), None in an atomic list."""
    kind = schema.list_type if schema is not None else "atomic"
    if kind == "map" and isinstance(item, Mapping):
        keys = {k: item.get(k, KEY_DEFAULTS.get(k)) for k in schema.map_keys}
        return "k:" + json.dumps({k: v for k, v in sorted(keys.items()) if v is not None}, separators=(",", ":"))
    if kind == "set":
        return "v:" + json.dumps(item, separators=(",", ":"))
    return None


def _associative(schema: Schema | None) -> bool:
    return schema is not None and schema.list_type in ("map", "set")


def _is_item(segment: str) -> bool:
    return segment.startswith(("k:", "v:"))


def leaves(obj: Mapping[str, Any], schema: Schema | None = None, prefix: Path = ()) -> Iterator[Path]:
    """The fields a manager can own in `obj`: scalars, atomic lists, empty maps, associative list items."""
    for key, value in obj.items():
        if not prefix and key in ("apiVersion", "kind"):
            continue
        if prefix == ("metadata",) and key in _UNTRACKED_META:
            continue
        path = (*prefix, key)
        sub = schema.field(key) if schema is not None else None
        if isinstance(value, dict) and value:
            yield from leaves(value, sub, path)
        elif isinstance(value, list) and _associative(sub):
            for item in value:
                item_path = (*path, str(item_segment(item, sub)))
                yield item_path
                if isinstance(item, dict):
                    yield from leaves(item, sub.items() if sub else None, item_path)
        else:
            yield path


def _find(items: list[Any], segment: str, schema: Schema | None) -> int | None:
    return next((i for i, item in enumerate(items) if item_segment(item, schema) == segment), None)


def value_at(obj: Any, path: Path, schema: Schema | None = None) -> Any:
    for key in path:
        if _is_item(key):
            index = _find(obj, key, schema) if isinstance(obj, list) else None
            if index is None:
                return _MISSING
            obj, schema = obj[index], schema.items() if schema else None
            continue
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj, schema = obj[key], schema.field(key) if schema else None
    return obj


def _remove(obj: dict[str, Any], path: Path, schema: Schema | None) -> None:
    """Delete `path` (a field or a list item), then any map or list it leaves empty."""
    parents: list[Any] = [obj]
    schemas: list[Schema | None] = [schema]
    for key in path[:-1]:
        parent, sub = parents[-1], schemas[-1]
        if _is_item(key):
            index = _find(parent, key, sub) if isinstance(parent, list) else None
            if index is None:
                return
            parents.append(parent[index])
            schemas.append(sub.items() if sub else None)
        else:
            if not isinstance(parent, dict) or key not in parent:
                return
            parents.append(parent[key])
            schemas.append(sub.field(key) if sub else None)
    last, parent = path[-1], parents[-1]
    if _is_item(last):
        index = _find(parent, last, schemas[-1]) if isinstance(parent, list) else None
        if index is not None:
            del parent[index]
    elif isinstance(parent, dict):
        parent.pop(last, None)
    for depth in range(len(path) - 1, 0, -1):
        if parents[depth] in ({}, []):
            holder, key = parents[depth - 1], path[depth - 1]
            if isinstance(holder, dict):
                holder.pop(key, None)
            elif isinstance(holder, list):
                _remove_item(holder, key, schemas[depth - 1])


def _remove_item(items: list[Any], segment: str, schema: Schema | None) -> None:
    index = _find(items, segment, schema)
    if index is not None:
        del items[index]


def merge(base: Any, config: Any, schema: Schema | None = None) -> Any:
    """`config` over `base`: maps merge key by key, associative lists item by item, atomic lists and scalars
    replace."""
    if isinstance(base, list) and isinstance(config, list) and _associative(schema):
        out = list(base)
        for item in config:
            index = _find(out, str(item_segment(item, schema)), schema)
            if index is None:
                out.append(copy.deepcopy(item))
            else:
                out[index] = merge(out[index], item, schema.items() if schema else None)
        return out
    if not (isinstance(base, dict) and isinstance(config, dict)):
        return copy.deepcopy(config)
    out = dict(base)
    for key, value in config.items():
        out[key] = merge(base.get(key), value, schema.field(key) if schema else None)
    return out


def _overlaps(a: Path, b: Path) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


# -- FieldsV1 ---------------------------------------------------------------------------------------------------


def _encode(segment: str) -> str:
    return segment if _is_item(segment) else f"f:{segment}"


def to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(_encode(key), {})
    for path in paths:  # "." marks a node that is owned itself and also has owned children
        node = tree
        for key in path:
            node = node[_encode(key)]
        if any(k != "." for k in node):
            node["."] = {}
    return tree


def from_fields_v1(tree: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    paths: set[Path] = set()
    children = {k: v for k, v in tree.items() if k.startswith(("f:", "k:", "v:"))}
    if prefix and (not tree or "." in tree):
        paths.add(prefix)
    for key, sub in children.items():
        paths |= from_fields_v1(sub, (*prefix, key[2:] if key.startswith("f:") else key))
    return paths


@dataclass(frozen=True)
class Owners:
    """Who owns what: {(manager, operation): paths}."""

    by_manager: dict[tuple[str, str], frozenset[Path]]

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Owners:
        found: dict[tuple[str, str], frozenset[Path]] = {}
        for entry in (obj.get("metadata") or {}).get("managedFields") or []:
            key = (entry.get("manager", ""), entry.get("operation", UPDATE))
            found[key] = frozenset(from_fields_v1(entry.get("fieldsV1") or {}))
        return cls(found)

    def entries(self, api_version: str) -> list[dict[str, Any]]:
        return [
            {"manager": manager, "operation": operation, "apiVersion": api_version, "fieldsType": "FieldsV1",
             "fieldsV1": to_fields_v1(set(paths))}
            for (manager, operation), paths in sorted(self.by_manager.items()) if paths
        ]  # fmt: skip


def stamp(obj: dict[str, Any], owners: Owners) -> dict[str, Any]:
    entries = owners.entries(obj.get("apiVersion", ""))
    meta = obj.setdefault("metadata", {})
    if entries:
        meta["managedFields"] = entries
    else:
        meta.pop("managedFields", None)
    return obj


def record_update(
    old: Mapping[str, Any] | None, new: dict[str, Any], manager: str, schema: Schema | None = None
) -> dict[str, Any]:
    """`new` (written by a non-apply request of `manager`) with managed fields moved to that manager."""
    owners = Owners.of(old or {})
    changed = {p for p in leaves(new, schema)
               if old is None or _differs(value_at(old, p, schema), value_at(new, p, schema), p)}  # fmt: skip
    gone = {p for paths in owners.by_manager.values() for p in paths if value_at(new, p, schema) is _MISSING}
    result: dict[tuple[str, str], frozenset[Path]] = {}
    for key, paths in owners.by_manager.items():
        kept = {p for p in paths if p not in gone and not any(_changes(p, c) for c in changed)}
        result[key] = frozenset(kept)
    mine = (manager, UPDATE)
    result[mine] = frozenset(set(result.get(mine, frozenset())) | changed)
    return stamp(new, Owners(result))


def _differs(before: Any, after: Any, path: Path) -> bool:
    """A field changed value; a list item changed only by coming or going (its fields have owners of their own)."""
    if path and _is_item(path[-1]):
        return (before is _MISSING) != (after is _MISSING)
    return before != after


def _changes(owned: Path, changed: Path) -> bool:
    """A change at `changed` takes `owned` from its owner: the same field, a field inside it, or the field that
    holds it. A list item's own entry is not taken by a change of one of its fields."""
    if owned[-1:] and _is_item(owned[-1]) and len(changed) > len(owned):
        return False
    return _overlaps(owned, changed)


class ApplyConflict(Exception):
    """An apply would change fields other managers own: the API server answers 409 Conflict."""

    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        listed = "; ".join(f'conflict with "{m}": .{".".join(p)}' for m, p in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {listed}")
        self.conflicts = conflicts


def apply(
    live: Mapping[str, Any] | None,
    config: Mapping[str, Any],
    manager: str,
    force: bool,
    schema: Schema | None = None,
) -> dict[str, Any]:
    """The object after `manager` applies `config` to `live` (None: the apply creates it)."""
    config = {k: v for k, v in config.items() if k != "status"}
    config["metadata"] = {k: v for k, v in (config.get("metadata") or {}).items() if k not in _UNTRACKED_META or
                          k in ("name", "namespace")}  # fmt: skip
    owners = Owners.of(live or {})
    mine = (manager, APPLY)
    applied = set(leaves(config, schema))
    previous = owners.by_manager.get(mine, frozenset())
    others = {k: v for k, v in owners.by_manager.items() if k != mine}
    result = copy.deepcopy(dict(live or {}))
    result.get("metadata", {}).pop("managedFields", None)
    # Shortest first: an item goes whole (its fields with it) unless another manager still owns a field of it;
    # then only this manager's fields of it go, never the key fields that name the item.
    removed: list[Path] = []
    for path in sorted(previous - applied, key=len):
        if any(path[: len(r)] == r for r in removed):
            continue
        shared = any(path in paths for paths in others.values())
        held = _is_item(path[-1]) and any(p[: len(path)] == path for paths in others.values() for p in paths)
        is_key = len(path) > 1 and _is_item(path[-2]) and path[-1] in json.loads(path[-2][2:] or "{}")
        if not shared and not held and not is_key:
            _remove(result, path, schema)
            removed.append(path)
    result = merge(result, config, schema)
    conflicts: list[tuple[str, Path]] = []
    kept: dict[tuple[str, str], frozenset[Path]] = {}
    for key, paths in others.items():
        stay = set()
        for path in paths:
            touched = any(_changes(path, a) for a in applied)
            if touched and _differs(value_at(live or {}, path, schema), value_at(result, path, schema), path):
                conflicts.append((key[0], path))
                continue  # forced: the field changes hands
            stay.add(path)
        kept[key] = frozenset(stay)
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    kept[mine] = frozenset(applied)
    return stamp(result, Owners(kept))


def manager_name(params: Mapping[str, str], user_agent: str) -> str:
    """The request's field manager: `?fieldManager=`, else the user agent up to its first "/" (as the API
    server names managers of clients that send none)."""
    return params.get("fieldManager") or user_agent.split("/", 1)[0] or "unknown"
