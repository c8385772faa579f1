"""The CRD is a valid, structural CRD; CR examples validate against its schema; defaults and paths agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hpi_operator import names
from hpi_testing.crd_schema import to_json_schema

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferencedeployments.serving.hpi.dev.yaml"
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def openapi_schema() -> dict[str, Any]:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def validate_cr(cr: dict[str, Any]) -> None:
    """Strict: unknown fields are rejected (the API server would drop them silently; in an example a typo
    must fail here instead)."""
    schema = to_json_schema(openapi_schema(), strict=True)
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is the API server's to check
    jsonschema.validate(cr, schema, cls=jsonschema.Draft7Validator)


def walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_passes_kubernetes_validate_strict(version: str) -> None:
    kubernetes_validate.validate(load_crd(), version, strict=True)


def test_crd_names_and_subresources() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == f"{names.PLURAL}.{names.GROUP}"
    assert crd["spec"]["group"] == names.GROUP and crd["spec"]["names"]["kind"] == names.KIND
    assert crd["spec"]["names"]["shortNames"] == ["infdep"]
    [version] = crd["spec"]["versions"]
    assert version["name"] == names.VERSION and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Replicas", "Ready", "Profile", "KV", "Age"]


def test_schema_is_structural() -> None:
    """The rules of https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/#specifying-a-structural-schema
    that kubernetes-validate does not check."""
    for path, node in walk(openapi_schema()):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            continue
        assert "type" in node, f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        if node["type"] == "array":
            assert "items" in node, path
        assert "description" not in node or node["description"].strip(), path
    metadata = openapi_schema()["properties"]["metadata"]
    assert set(metadata["properties"]) <= {"name", "generateName"}  # all a CRD may restrict in metadata


def test_json_paths_exist_in_the_schema() -> None:
    version = load_crd()["spec"]["versions"][0]
    props = openapi_schema()["properties"]

    def resolve(json_path: str) -> None:
        node = {"properties": props}
        for part in json_path.strip(".").split("."):
            if part == "metadata":
                return
            node = node["properties"][part]

    for column in version["additionalPrinterColumns"]:
        resolve(column["jsonPath"])
    for key in ("specReplicasPath", "statusReplicasPath", "labelSelectorPath"):
        resolve(version["subresources"]["scale"][key])


def test_spec_has_descriptions_defaults_enums_and_bounds() -> None:
    spec = openapi_schema()["properties"]["spec"]["properties"]
    assert spec["model"]["properties"]["source"]["enum"] == ["embedded", "pvc", "huggingface"]
    assert spec["replicas"]["minimum"] == 0 and spec["replicas"]["default"] == 1
    assert spec["engine"]["properties"]["kvCacheMemoryFraction"]["maximum"] < 1
    assert spec["placement"]["properties"]["profile"]["properties"]["quantization"]["enum"] == [
        "auto", "none", "int8", "int4"
    ]  # fmt: skip
    autoscaling = spec["autoscaling"]["properties"]
    for field in ("enabled", "mode", "minReplicas", "maxReplicas", "targetKVUtilization", "targetWaitingRequests",
                  "scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds", "maxScaleStep",
                  "pollIntervalSeconds", "scaleToZero"):  # fmt: skip
        assert field in autoscaling, field
    described = [path for path, node in walk(openapi_schema()["properties"]["spec"]) if node.get("description")]
    assert len(described) >= 30


SAMPLE_CRS = [
    {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "tiny"}, "spec": {}},
    {
        "apiVersion": "serving.hpi.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "llama", "namespace": "ml", "labels": {"team": "a"}},
        "spec": {
            "model": {
                "source": "huggingface",
                "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct", "tokenSecretRef": {"name": "hf"}},
                "size": {"parameters": "8B"},
            },
            "replicas": 3,
            "runtime": {
                "image": "registry.local/hpi-runtime:1",
                "extraArgs": ["--seed", "1"],
                "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            },
            "engine": {"maxModelLen": 8192, "maxNumSeqs": 128, "kvCacheMemoryFraction": 0.85, "blockSize": 32},
            "placement": {
                "allowedPools": ["gpu-l4", "cpu-amd64-bf16"],
                "preferredPools": ["gpu-l4"],
                "nodeSelector": {"topology.kubernetes.io/zone": "a"},
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
                "profile": {"device": "auto", "dtype": "auto", "quantization": "auto"},
                "forbiddenQuantizations": ["int4"],
            },
            "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": 17179869184}},
            "apiKeySecretRef": {"name": "api"},
            "autoscaling": {
                "enabled": True,
                "mode": "hpa",
                "minReplicas": 1,
                "maxReplicas": 6,
                "targetKVUtilization": 0.7,
                "scaleToZero": {"enabled": False},
            },
        },
    },
]


def example_crs() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == names.KIND:
                found.append((str(path.relative_to(REPO)), doc))
    return found


@pytest.mark.parametrize("cr", SAMPLE_CRS, ids=lambda cr: cr["metadata"]["name"])
def test_sample_crs_validate(cr: dict[str, Any]) -> None:
    validate_cr(cr)


@pytest.mark.parametrize(("path", "cr"), example_crs() or [pytest.param("", {}, marks=pytest.mark.skip("no examples"))])
def test_example_crs_validate(path: str, cr: dict[str, Any]) -> None:
    validate_cr(cr)


@pytest.mark.parametrize(
    "spec",
    [
        {"replicas": -1},
        {"model": {"source": "s3"}},
        {"engine": {"blockSize": 12}},
        {"engine": {"kvCacheDtype": "fp16"}},
        {"engine": {"kvCacheMemoryFraction": 1.5}},
        {"placement": {"profile": {"quantization": "fp8"}}},
        {"autoscaling": {"targetKVUtilization": 2}},
        {"autoscaling": {"mode": "vpa"}},
        {"modle": {}},
        {"model": {"size": {"parameters": "eight billion"}}},
        {"resources": {"limits": {"memory": "lots"}}},
    ],
)
def test_bad_crs_are_rejected_by_the_schema(spec: dict[str, Any]) -> None:
    cr = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "x"}}
    cr["spec"] = spec
    with pytest.raises(jsonschema.ValidationError):
        validate_cr(cr)
