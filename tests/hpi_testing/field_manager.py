"""Server-side apply and managed fields, as the emulator does them (pure functions on plain dicts).

A field manager owns leaf fields: scalars, and lists taken whole (the emulator treats every list as atomic;
the API server keys some lists by a merge key, e.g. containers by name, which only refines what a manager owns
inside a list). Ownership is recorded in `metadata.managedFields` in the API server's FieldsV1 shape
(`{"f:spec": {"f:replicas": {}}}`), one entry per manager and operation.

- An update (POST, PUT, merge or JSON patch) gives its manager every field whose value it changed and takes
  those fields from the managers that owned them.
- An apply sets the fields of its configuration, removes the fields its manager applied before and no longer
  applies (unless another manager also owns them), and conflicts (409) where it would change a field another
  manager owns, unless forced: then the field changes hands.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

Path = tuple[str, ...]
APPLY, UPDATE = "Apply", "Update"
_UNTRACKED_META = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                   "managedFields", "deletionTimestamp", "generateName", "selfLink")  # fmt: skip
_MISSING = object()


def leaves(obj: Mapping[str, Any], prefix: Path = ()) -> Iterator[Path]:
    """The fields a manager can own in `obj`: scalars, whole lists, and empty maps."""
    for key, value in obj.items():
        if not prefix and key in ("apiVersion", "kind"):
            continue
        if prefix == ("metadata",) and key in _UNTRACKED_META:
            continue
        path = (*prefix, key)
        if isinstance(value, dict) and value:
            yield from leaves(value, path)
        else:
            yield path


def value_at(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _remove(obj: dict[str, Any], path: Path) -> None:
    """Delete `path`, then any map it leaves empty (no one owns an empty map nobody set)."""
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if parents[depth] == {}:
            parents[depth - 1].pop(path[depth - 1], None)


def merge(base: Any, config: Any) -> Any:
    """`config` over `base`: maps merge key by key; lists and scalars replace."""
    if not (isinstance(base, dict) and isinstance(config, dict)):
        return copy.deepcopy(config)
    out = dict(base)
    for key, value in config.items():
        out[key] = merge(base.get(key), value)
    return out


def _overlaps(a: Path, b: Path) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


# -- FieldsV1 ---------------------------------------------------------------------------------------------------


def to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
        if node:
            node["."] = {}
    return tree


def from_fields_v1(tree: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    paths: set[Path] = set()
    children = {k: v for k, v in tree.items() if k.startswith("f:")}
    if prefix and (not tree or "." in tree):
        paths.add(prefix)
    for key, sub in children.items():
        paths |= from_fields_v1(sub, (*prefix, key[2:]))
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


def record_update(old: Mapping[str, Any] | None, new: dict[str, Any], manager: str) -> dict[str, Any]:
    """`new` (written by a non-apply request of `manager`) with managed fields moved to that manager."""
    owners = Owners.of(old or {})
    changed = {p for p in leaves(new) if old is None or value_at(old, p) != value_at(new, p)}
    gone = {p for paths in owners.by_manager.values() for p in paths if value_at(new, p) is _MISSING}
    result: dict[tuple[str, str], frozenset[Path]] = {}
    for key, paths in owners.by_manager.items():
        kept = {p for p in paths if p not in gone and not any(_overlaps(p, c) for c in changed)}
        result[key] = frozenset(kept)
    mine = (manager, UPDATE)
    result[mine] = frozenset(set(result.get(mine, frozenset())) | changed)
    return stamp(new, Owners(result))


class ApplyConflict(Exception):
    """An apply would change fields other managers own: the API server answers 409 Conflict."""

    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        listed = "; ".join(f'conflict with "{m}": .{".".join(p)}' for m, p in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): {listed}")
        self.conflicts = conflicts


def apply(live: Mapping[str, Any] | None, config: Mapping[str, Any], manager: str, force: bool) -> dict[str, Any]:
    """The object after `manager` applies `config` to `live` (None: the apply creates it)."""
    config = {k: v for k, v in config.items() if k != "status"}
    config["metadata"] = {k: v for k, v in (config.get("metadata") or {}).items() if k not in _UNTRACKED_META or
                          k in ("name", "namespace")}  # fmt: skip
    owners = Owners.of(live or {})
    mine = (manager, APPLY)
    applied = set(leaves(config))
    previous = owners.by_manager.get(mine, frozenset())
    others = {k: v for k, v in owners.by_manager.items() if k != mine}
    result = copy.deepcopy(dict(live or {}))
    result.get("metadata", {}).pop("managedFields", None)
    for path in previous - applied:
        if not any(path in paths for paths in others.values()):
            _remove(result, path)
    result = merge(result, config)
    conflicts: list[tuple[str, Path]] = []
    kept: dict[tuple[str, str], frozenset[Path]] = {}
    for key, paths in others.items():
        stay = set()
        for path in paths:
            touched = any(_overlaps(path, a) for a in applied)
            if touched and value_at(live or {}, path) != value_at(result, path):
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
