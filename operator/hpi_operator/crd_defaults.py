"""The InferenceDeployment's defaults, declared in one place: the CRD's schema (a copy ships in this package,
crds/, generated from the repository's crds/ by `make crds`; tests/chart/test_crds.py fails when it is stale).

On a cluster the API server fills them in before the operator sees a resource. `with_defaults` does the same
for specs no server has seen (`hpi-operator render`, tests), and `crd_default` gives the spec dataclasses
their field defaults from the same schema, so nothing restates a default value in Python.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml

CRD_FILE = "inferencedeployments.serving.hpi.dev.yaml"


@functools.cache
def _spec_schema() -> Mapping[str, Any]:
    text = resources.files(__package__).joinpath("crds", CRD_FILE).read_text()
    crd = yaml.safe_load(text)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def crd_default(path: str) -> Any:
    """The CRD's default of `spec.<path>` (dotted, e.g. "engine.maxModelLen"); KeyError when it has none."""
    node = _spec_schema()
    for key in path.split("."):
        node = node["properties"][key]
    return copy.deepcopy(node["default"])


def _fill(schema: Mapping[str, Any], value: Any) -> Any:
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for key, sub in properties.items():
            if value.get(key) is None and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _fill(sub, value[key])
    elif isinstance(value, list):
        return [_fill(schema.get("items") or {}, item) for item in value]
    return value


def with_defaults(spec: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of `spec` with the CRD's defaults filled in, as the API server's structural defaulting does it
    (recursively: a defaulted `{}` gets its own fields' defaults; an explicit null is treated as absent)."""
    return _fill(_spec_schema(), copy.deepcopy(dict(spec or {})))
