"""Kubernetes' published OpenAPI for the built-in kinds, as the emulator reads it: field types, list semantics
(`x-kubernetes-list-type`, `x-kubernetes-list-map-keys`, `x-kubernetes-patch-strategy`,
`x-kubernetes-patch-merge-key`) and which fields are quantities.

The definitions are the ones `kubernetes-validate` ships, generated from the API server's own OpenAPI of one
pinned release (SCHEMA_VERSION), never restated from memory. A custom resource's structural schema (from its
CRD) is navigated the same way: it carries list types and map keys too, but no patch strategy (the API server
refuses strategic merge patches of custom resources).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate

SCHEMA_VERSION = "v1.37.0"  # pinned: list semantics and defaults are those of this release
_SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"{SCHEMA_VERSION}-local"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"


@functools.cache
def _definitions() -> dict[str, Any]:
    return json.loads((_SCHEMAS / "_definitions.json").read_text())["$defs"]


@functools.cache
def _kinds() -> dict[tuple[str, str], str]:
    """(apiVersion, kind) -> definition name, from each definition's x-kubernetes-group-version-kind."""
    found = {}
    for name, node in _definitions().items():
        for gvk in node.get("x-kubernetes-group-version-kind") or []:
            api_version = f"{gvk['group']}/{gvk['version']}" if gvk.get("group") else gvk["version"]
            found[api_version, gvk["kind"]] = name
    return found


@dataclass(frozen=True)
class Schema:
    """One node of a schema; `name` is the definition it was reached through ($ref), if any."""

    node: Mapping[str, Any]
    name: str | None = None

    @classmethod
    def of(cls, node: Mapping[str, Any] | None) -> Schema | None:
        if node is None:
            return None
        ref = node.get("$ref")
        if ref:
            name = ref.rsplit("/", 1)[-1]
            return cls({**_definitions()[name], **{k: v for k, v in node.items() if k != "$ref"}}, name)
        return cls(node)

    def field(self, key: str) -> Schema | None:
        properties = self.node.get("properties") or {}
        if key in properties:
            return Schema.of(properties[key])
        extra = self.node.get("additionalProperties")
        return Schema.of(extra) if isinstance(extra, Mapping) else None

    def items(self) -> Schema | None:
        return Schema.of(self.node.get("items"))

    @property
    def is_quantity(self) -> bool:
        return self.name == QUANTITY

    @property
    def list_type(self) -> str:
        """map | set | atomic. Lists the OpenAPI leaves unmarked are atomic (structured-merge-diff's default)."""
        declared = self.node.get("x-kubernetes-list-type")
        if declared:
            return declared
        return "map" if self.map_keys else "atomic"

    @property
    def map_keys(self) -> tuple[str, ...]:
        keys = self.node.get("x-kubernetes-list-map-keys")
        if keys:
            return tuple(keys)
        merge_key = self.node.get("x-kubernetes-patch-merge-key")
        return (merge_key,) if merge_key and self.list_type_declared != "atomic" else ()

    @property
    def list_type_declared(self) -> str | None:
        return self.node.get("x-kubernetes-list-type")

    @property
    def patch_strategies(self) -> tuple[str, ...]:
        return tuple(filter(None, (self.node.get("x-kubernetes-patch-strategy") or "").split(",")))

    @property
    def patch_merge_key(self) -> str | None:
        return self.node.get("x-kubernetes-patch-merge-key")


def builtin_schema(api_version: str, kind: str) -> Schema | None:
    """The published schema of a built-in kind (None for custom resources and unknown kinds)."""
    name = _kinds().get((api_version, kind))
    return Schema(_definitions()[name], name) if name else None


@functools.cache
def _validator(api_version: str, kind: str) -> Any:
    """A JSON Schema validator of the kind's strict published schema (unknown fields are errors), built once."""
    import jsonschema
    import referencing

    group_version = api_version.split("/")
    prefix = group_version[0].split(".")[0] + "-" if len(group_version) == 2 else ""
    path = _SCHEMAS.with_name(f"{SCHEMA_VERSION}-local-strict") / f"{kind.lower()}-{prefix}{group_version[-1]}.json"
    if not path.exists():
        return None
    definitions = json.loads((path.parent / "_definitions.json").read_text())
    schema = json.loads(path.read_text())
    registry = referencing.Registry().with_resources([
        (definitions["$id"], referencing.Resource.from_contents(definitions)),
    ])  # fmt: skip
    return jsonschema.Draft202012Validator(schema, registry=registry)


@dataclass(frozen=True)
class Validation:
    unknown: tuple[tuple[str, ...], ...]  # paths of fields the schema does not declare (dropped, as the server does)
    errors: tuple[str, ...]  # "field: message" of every other failure (422)


def validate(obj: Mapping[str, Any]) -> Validation:
    """Check a built-in object against its published schema: types, enums, required fields; unknown fields."""
    validator = _validator(str(obj.get("apiVersion") or ""), str(obj.get("kind") or ""))
    if validator is None:
        return Validation((), ())
    unknown, errors = [], []
    for error in validator.iter_errors(obj):
        where = tuple(str(p) for p in error.absolute_path)
        if error.validator == "additionalProperties":
            declared = set(error.schema.get("properties") or {})
            unknown += [(*where, key) for key in error.instance if key not in declared]
        else:
            errors.append(f"{'.'.join(where) or '<root>'}: {error.message}")
    return Validation(tuple(unknown), tuple(errors))
