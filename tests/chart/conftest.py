"""Fixtures for the Helm chart tests: the real helm binary, cached renders, and schema validators.

Nothing here is skipped when a tool is missing: the chart is the install path users take, so a missing
helm fails loudly with the command that fetches it.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "hetero-paged-infer"
CRD_FILE = REPO / "crds" / "inferencedeployments.serving.hpi.dev.yaml"
RELEASE = "hpi"
NAMESPACE = "hpi-system"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", "1.37.0")

# Every optional feature on at once: the ServiceMonitor, the runtime PodMonitor, the dashboard, the operator's
# NetworkPolicy, the default
# InferenceDeployment, a single watched namespace (Role + RoleBinding), pull secrets, scheduling knobs, extra
# args/env.
ALL_FEATURES: dict[str, Any] = {
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {
        "watchNamespace": "team-a",
        "logLevel": "debug",
        "extraArgs": ["--verbose"],
        "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
    },
    "serviceAccount": {"annotations": {"iam.example.com/role": "hpi-operator"}},
    "podAnnotations": {"example.com/team": "ml-platform"},
    "podLabels": {"example.com/tier": "control-plane"},
    "priorityClassName": "system-cluster-critical",
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [{"key": "ops", "operator": "Exists"}]}}
            ]
        }
    },
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "runtimeMetrics": {"podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM serving"}},
    "networkPolicy": {
        "enabled": True,
        "prometheus": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
            {"ipBlock": {"cidr": "10.0.0.0/8"}},
        ],
    },
    "defaultInferenceDeployment": {
        "enabled": True,
        "replicas": 2,
        "runtimeImage": "registry.example.com/hpi/runtime:0.1.0",
        "rocmRuntimeImage": "registry.example.com/hpi/runtime:0.1.0-rocm",
        "routerImage": "registry.example.com/hpi/router:0.1.0",
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}},
    },
}


def find_helm() -> str:
    """helm on PATH, else the copy `make test` fetches into .cache/bin."""
    found = shutil.which("helm")
    if found:
        return found
    cached = REPO / ".cache" / "bin" / "helm"
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    pytest.fail(
        "the chart tests need the real helm binary: none on PATH and none at .cache/bin/helm. "
        "Fetch it with `make .cache/bin/helm` (or `make test`, which does it first).",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def helm() -> str:
    return find_helm()


def run_helm(helm: str, *args: str, values: Mapping[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    """Run helm with `values` passed as a values file (JSON is YAML), capturing its output."""
    command = [helm, *args]
    if values is not None:
        command += ["--values", "-"]
    return subprocess.run(
        command, input=json.dumps(values) if values is not None else None, capture_output=True, text=True, timeout=60
    )


Renderer = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def render(helm: str) -> Renderer:
    """`render(values, kube_version=..., release=...)` -> the rendered manifests; fails the test on a helm error."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def _render(
        values: Mapping[str, Any] | None = None, kube_version: str = KUBE_VERSIONS[-1], release: str = RELEASE
    ) -> list[dict[str, Any]]:
        key = json.dumps([values, kube_version, release], sort_keys=True)
        if key not in cache:
            result = run_helm(
                helm, "template", release, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version,
                values=values or {},
            )  # fmt: skip
            assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
            cache[key] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        return copy.deepcopy(cache[key])

    return _render


def by_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def _structural_to_jsonschema(node: Any, strict: bool) -> Any:
    """An OpenAPI v3 structural schema as JSON Schema, with the Kubernetes extensions mapped.

    - `x-kubernetes-int-or-string`: an integer or a string;
    - `nullable`: null is allowed too;
    - objects with declared properties reject unknown fields, as `kubectl apply` (strict field validation)
      does, unless `x-kubernetes-preserve-unknown-fields` says otherwise.
    """
    if isinstance(node, list):
        return [_structural_to_jsonschema(item, strict) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: _structural_to_jsonschema(value, strict)
        for key, value in node.items()
        if not key.startswith("x-kubernetes-") and key != "nullable"
    }
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        strict
        and node.get("type") == "object"
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(crd: Mapping[str, Any], version: str = "v1alpha1") -> jsonschema.Draft7Validator:
    """A validator for instances of `crd` at `version` (metadata is the API server's business)."""
    served = {v["name"]: v for v in crd["spec"]["versions"]}
    schema = _structural_to_jsonschema(served[version]["schema"]["openAPIV3Schema"], strict=True)
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def schema_errors(validator: jsonschema.Draft7Validator, instance: Mapping[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(instance)]


@dataclass(frozen=True)
class ChartEnv:
    """Paths, constants and helpers shared by the chart tests (importlib mode: conftest is not importable)."""

    repo: Path = REPO
    chart: Path = CHART
    crd_file: Path = CRD_FILE
    release: str = RELEASE
    namespace: str = NAMESPACE
    kube_versions: tuple[str, ...] = KUBE_VERSIONS
    all_features: Mapping[str, Any] = field(default_factory=lambda: copy.deepcopy(ALL_FEATURES))
    by_kind: Callable[[list[dict[str, Any]], str], list[dict[str, Any]]] = by_kind
    crd_validator: Callable[..., jsonschema.Draft7Validator] = crd_validator
    schema_errors: Callable[[jsonschema.Draft7Validator, Mapping[str, Any]], list[str]] = schema_errors
    run_helm: Callable[..., subprocess.CompletedProcess[str]] = run_helm


@pytest.fixture(scope="session")
def env() -> ChartEnv:
    return ChartEnv()


@pytest.fixture(scope="session")
def idp_validator() -> jsonschema.Draft7Validator:
    return crd_validator(yaml.safe_load(CRD_FILE.read_text()))
