"""CRD validation rules (`x-kubernetes-validations`), evaluated as the API server does on every write of a
custom resource, with cel-python (a CEL implementation; the API server uses cel-go).

Each rule is evaluated where it is declared, with `self` bound to the value there (and `oldSelf` to the
previous value on an update: a rule that uses oldSelf is a transition rule and is skipped on create or where
there was no old value). A rule whose node is absent is not evaluated. A failed rule reads as the API server
words it: `spec.autoscaling: Invalid value: "object": minReplicas must not exceed maxReplicas` (the rule's
`message`, else `failed rule: <rule>`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import celpy

_MISSING = object()


@functools.cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    return json.dumps(value)


def _check(rules: list[Mapping[str, Any]], value: Any, old: Any, path: str) -> list[str]:
    errors = []
    for rule in rules:
        text = rule["rule"]
        transition = "oldSelf" in text
        if transition and old is _MISSING:
            continue
        activation = {"self": celpy.json_to_cel(value)}
        if transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        try:
            passed = bool(_program(text).evaluate(activation))
        except celpy.CELEvalError as e:
            errors.append(f"{path or '<root>'}: Invalid value: {_shown(value)}: rule evaluation error: {e}")
            continue
        if not passed:
            errors.append(f"{path or '<root>'}: Invalid value: {_shown(value)}: "
                          f"{rule.get('message') or 'failed rule: ' + text}")  # fmt: skip
    return errors


def rule_errors(value: Any, schema: Mapping[str, Any], old: Any = _MISSING, path: str = "") -> list[str]:
    """Every failed `x-kubernetes-validations` rule in `value` (a custom resource or a part of one)."""
    errors = _check(schema.get("x-kubernetes-validations") or [], value, old, path)
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else None
        for key, sub_value in value.items():
            sub = properties.get(key, extra)
            if sub is not None:
                sub_old = old.get(key, _MISSING) if isinstance(old, dict) else _MISSING
                errors += rule_errors(sub_value, sub, sub_old, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += rule_errors(item, schema["items"], _MISSING, f"{path}[{i}]")
    return errors
