"""Strategic merge patch (`application/strategic-merge-patch+json`), as the API server applies it to built-in
kinds (k8s.io/apimachinery/pkg/util/strategicpatch), driven by the published OpenAPI (k8s_openapi.py).

- Maps merge key by key; `null` deletes a key.
- A list whose field has `x-kubernetes-patch-strategy: merge` is merged item by item by its
  `x-kubernetes-patch-merge-key` (containers by name, container ports by containerPort, volumeMounts by
  mountPath, ...): a patch item updates the item with the same key or is appended; `{"$patch": "delete", key}`
  removes an item; `{"$patch": "replace"}` among the items replaces the whole list. Merge lists of scalars
  (finalizers) take the union; `$deleteFromPrimitiveList/<field>` removes values from one.
- Every other list (tolerations, args, command) is replaced whole.
- `{"$patch": "replace"}` in a map replaces the map, `{"$patch": "delete"}` deletes it; `$retainKeys` (fields
  with the `retainKeys` strategy: volumes, a Deployment's strategy) clears the keys it does not list;
  `$setElementOrder/<field>` orders the merged list.
Custom resources have no patch strategies: the API server answers 415 to a strategic merge patch of one.
"""

from __future__ import annotations

import copy
from typing import Any

from hpi_testing.k8s_openapi import Schema

_DELETE = object()


class StrategicMergeError(ValueError):
    """A patch the API server cannot apply: answered 422 (or 400 for a malformed directive)."""


def strategic_merge(original: Any, patch: Any, schema: Schema | None) -> Any:
    """`patch` applied to `original` (both plain JSON); returns a new object."""
    result = _merge_map(original, patch, schema)
    return {} if result is _DELETE else result


def _merge_map(original: Any, patch: Any, schema: Schema | None) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return _DELETE
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive is not None:
        raise StrategicMergeError(f"unknown patch type {directive!r}")
    result = dict(original) if isinstance(original, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        sub = schema.field(key) if schema is not None else None
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, sub)
        else:
            merged = _merge_map(result.get(key), value, sub)
            if merged is _DELETE:
                result.pop(key, None)
            else:
                result[key] = merged
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [v for v in result.get(field) or [] if v not in value]
        elif key.startswith("$setElementOrder/"):
            field = key.split("/", 1)[1]
            result[field] = _ordered(result.get(field) or [], value, schema.field(field) if schema else None)
    retain = patch.get("$retainKeys")
    if retain is not None:
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(original: Any, patch: list[Any], schema: Schema | None) -> list[Any]:
    if schema is None or "merge" not in schema.patch_strategies:
        return [item for item in copy.deepcopy(patch) if not _is_directive(item)]
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(item) for item in patch if not _is_directive(item)]
    out = list(original) if isinstance(original, list) else []
    key = schema.patch_merge_key
    if key is None:  # a merge list of scalars: the union, in order
        return out + [copy.deepcopy(v) for v in patch if v not in out]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise StrategicMergeError(f"map: {item!r} does not contain declared merge key: {key}")
        index = next((i for i, o in enumerate(out) if isinstance(o, dict) and o.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del out[index]
        elif index is None:
            out.append({k: copy.deepcopy(v) for k, v in item.items() if v is not None and k != "$patch"})
        else:
            out[index] = _merge_map(out[index], item, schema.items())
    return out


def _is_directive(item: Any) -> bool:
    return isinstance(item, dict) and set(item) == {"$patch"}


def _ordered(items: list[Any], order: list[Any], schema: Schema | None) -> list[Any]:
    key = schema.patch_merge_key if schema is not None else None

    def rank(item: Any) -> int:
        probe = item.get(key) if key and isinstance(item, dict) else item
        wanted = [o.get(key) if key and isinstance(o, dict) else o for o in order]
        return wanted.index(probe) if probe in wanted else len(wanted)

    return sorted(items, key=rank)
