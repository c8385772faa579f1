"""What a kube-apiserver does with a custom resource's structural schema, for the emulator and the CRD tests.

On every write of a custom resource the API server, in this order: drops `null` where the schema does not
say `nullable`, prunes fields the schema does not declare (unless `x-kubernetes-preserve-unknown-fields`),
fills `default`s (recursively: a defaulted `{}` gets its own fields' defaults), then validates (types,
enums, bounds, required) and answers 422 when that fails. `apply_schema` does the same, and says which
fields it pruned, so tests can fail where a real cluster would silently drop a field.

Validation maps OpenAPI v3 to JSON Schema for `jsonschema`: `x-kubernetes-int-or-string` is integer or
string, `nullable` adds "null", OpenAPI 3.0's boolean `exclusiveMinimum`/`exclusiveMaximum` become JSON Schema's
numbers. CEL rules (`x-kubernetes-validations`) are evaluated after it (cel_rules.py),
with the old object for transition rules.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonschema

from hpi_testing.cel_rules import rule_errors

ROOT_FIELDS = ("apiVersion", "kind", "metadata")  # ObjectMeta and the type are the API server's own


def to_json_schema(node: Mapping[str, Any], strict: bool = False) -> dict[str, Any]:
    """An OpenAPI v3 structural schema as a JSON Schema; `strict` also rejects undeclared fields (for
    examples, where a typo must fail instead of being pruned)."""
    node = copy.deepcopy(dict(node))
    if node.pop("x-kubernetes-int-or-string", False):
        string = {"type": "string", **({"pattern": node["pattern"]} if "pattern" in node else {})}
        return {"anyOf": [{"type": "integer"}, string]}
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), bool):  # OpenAPI 3.0's flag on minimum/maximum; JSON Schema's own number
            if node.pop(bound) and limit in node:
                node[bound] = node.pop(limit)
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    preserve = node.pop("x-kubernetes-preserve-unknown-fields", False)
    for key in [k for k in node if k.startswith("x-kubernetes-")]:
        node.pop(key)
    if "properties" in node:
        node["properties"] = {k: to_json_schema(v, strict) for k, v in node["properties"].items()}
        if strict and not preserve and "additionalProperties" not in node:
            node["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = to_json_schema(node["additionalProperties"], strict)
    if "items" in node:
        node["items"] = to_json_schema(node["items"], strict)
    return node


def root_json_schema(schema: Mapping[str, Any], strict: bool = False) -> dict[str, Any]:
    """The whole object's schema: ObjectMeta, apiVersion and kind are checked by the API server itself."""
    root = to_json_schema(schema, strict)
    root.setdefault("properties", {}).update({field: {} for field in ROOT_FIELDS})
    return root


def _drop_nulls(obj: Any, schema: Mapping[str, Any]) -> Any:
    if isinstance(obj, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else None
        out = {}
        for key, value in obj.items():
            sub = properties.get(key, extra or {})
            if value is None and not sub.get("nullable"):
                continue
            out[key] = _drop_nulls(value, sub)
        return out
    if isinstance(obj, list):
        return [_drop_nulls(item, schema.get("items") or {}) for item in obj]
    return obj


def _prune(obj: Any, schema: Mapping[str, Any], path: str, pruned: list[str]) -> Any:
    if schema.get("x-kubernetes-embedded-resource"):
        return obj
    if isinstance(obj, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        out = {}
        for key, value in obj.items():
            if properties is not None and key in properties:
                out[key] = _prune(value, properties[key], f"{path}.{key}", pruned)
            elif isinstance(extra, dict):
                out[key] = _prune(value, extra, f"{path}.{key}", pruned)
            elif preserve or extra is True:
                out[key] = value
            else:
                pruned.append(f"{path}.{key}")
        return out
    if isinstance(obj, list):
        return [_prune(item, schema.get("items") or {}, f"{path}[{i}]", pruned) for i, item in enumerate(obj)]
    return obj


def _default(obj: Any, schema: Mapping[str, Any]) -> Any:
    if isinstance(obj, dict):
        properties = schema.get("properties") or {}
        for key, sub in properties.items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
        for key, value in obj.items():
            if key in properties:
                obj[key] = _default(value, properties[key])
            elif isinstance(schema.get("additionalProperties"), dict):
                obj[key] = _default(value, schema["additionalProperties"])
    elif isinstance(obj, list):
        return [_default(item, schema.get("items") or {}) for item in obj]
    return obj


@dataclass(frozen=True)
class SchemaResult:
    obj: dict[str, Any]
    pruned: tuple[str, ...]  # ".status.foo" paths the schema does not declare, dropped
    errors: tuple[str, ...]  # validation failures: the API server answers 422 Invalid


def apply_schema(
    obj: Mapping[str, Any], schema: Mapping[str, Any], old: Mapping[str, Any] | None = None
) -> SchemaResult:
    """Drop undeclared nulls, prune, default and validate `obj` (a whole custom resource) as the API server does;
    `old`: the object it replaces, for CEL transition rules."""
    body = {k: v for k, v in obj.items() if k not in ROOT_FIELDS}
    pruned: list[str] = []
    body = _default(_prune(_drop_nulls(body, schema), schema, "", pruned), schema)
    result = {**{k: copy.deepcopy(obj[k]) for k in ROOT_FIELDS if k in obj}, **body}
    validator = jsonschema.Draft7Validator(root_json_schema(schema))
    errors = sorted(
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in validator.iter_errors(result)
    )
    if not errors:  # rules assume the types the schema guarantees
        old_body = {k: v for k, v in old.items() if k not in ROOT_FIELDS} if old is not None else None
        errors = rule_errors(body, schema, *(() if old_body is None else (old_body,)))
    return SchemaResult(result, tuple(pruned), tuple(errors))


def crd_schemas(crd: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{"group/version/plural": openAPIV3Schema} for every served version of a CustomResourceDefinition."""
    spec = crd.get("spec") or {}
    plural = spec["names"]["plural"]
    return {
        f"{spec['group']}/{version['name']}/{plural}": version["schema"]["openAPIV3Schema"]
        for version in spec.get("versions") or []
        if version.get("served", True) and (version.get("schema") or {}).get("openAPIV3Schema")
    }
