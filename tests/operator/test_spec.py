"""Spec parsing: defaults (in step with the CRD's), and the rules the schema cannot express."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpi_operator import spec as spec_module
from hpi_operator.crd_defaults import with_defaults
from hpi_operator.spec import AutoscalingSpec, EngineSpec, InferenceSpec, SpecError, parse_parameter_count, parse_spec
from hpi_testing.crd_schema import apply_schema

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "inferencedeployments.serving.hpi.dev.yaml"


def crd_schema() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def server_defaulted(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` as the API server stores it (the emulator's structural defaulting, crd_schema.py)."""
    return apply_schema({"spec": spec}, crd_schema()).obj["spec"]


HF_MODEL = {"source": "huggingface", "huggingface": {"id": "o/m", "tokenSecretRef": {"name": "t"}},
            "cache": {"enabled": True}}  # fmt: skip
SPECS = [{}, {"autoscaling": {"enabled": True}}, {"placement": {"profile": {"dtype": "bf16"}}},
         {"model": HF_MODEL, "routing": {"router": {}}, "apiKeySecretRef": {"name": "k"}}]  # fmt: skip


def test_empty_spec_is_the_embedded_model_with_one_replica() -> None:
    spec = parse_spec({})
    assert spec == InferenceSpec()
    assert spec.model.source == "embedded" and spec.replicas == 1


@pytest.mark.parametrize("raw", SPECS)
def test_server_defaulted_spec_parses_to_the_same_as_the_bare_one(raw: dict[str, Any]) -> None:
    assert parse_spec(server_defaulted(raw)) == parse_spec(raw)


@pytest.mark.parametrize("raw", SPECS)
def test_the_operator_defaults_a_spec_as_the_api_server_does(raw: dict[str, Any]) -> None:
    """`hpi-operator render` sees what the operator on a cluster would: the same defaults, from the same CRD."""
    assert with_defaults(raw) == server_defaulted(raw)


def test_defaults_are_declared_only_in_the_crd() -> None:
    """The spec dataclasses take their defaults from the CRD (no value restated in Python). That the copy of the
    CRD the operator package ships is fresh, tests/chart/test_crds.py checks (`make crds` writes it)."""
    props = crd_schema()["properties"]["spec"]["properties"]
    assert EngineSpec().max_model_len == props["engine"]["properties"]["maxModelLen"]["default"]
    autoscaling = props["autoscaling"]["properties"]
    assert AutoscalingSpec().target_kv_utilization == autoscaling["targetKVUtilization"]["default"]
    source = Path(spec_module.__file__).read_text()
    restated = re.findall(r"^\s+(\w+): (?:int|float|str|bool) = (?!crd_default)[^N(].*$", source, flags=re.MULTILINE)
    # checkpoint_quantization holds the parsed form: the CRD's "auto" resolved against the model id.
    assert restated == ["checkpoint_quantization"], "defaults restated in spec.py instead of read from the CRD"


@pytest.mark.parametrize(
    ("text", "count"), [(135_000_000, 135_000_000), ("135M", 135_000_000), ("8B", 8 * 10**9), ("1.7b", 1_700_000_000)]
)
def test_parameter_counts(text: Any, count: int) -> None:
    assert parse_parameter_count(text) == count


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"model": {"source": "pvc"}}, "claimName"),
        ({"model": {"source": "huggingface"}}, "huggingface.id"),
        ({"model": {"source": "pvc", "pvc": {"claimName": "w", "path": "../etc"}}}, "inside the volume"),
        ({"model": {"size": {"parameters": "lots"}}}, "parameters"),
        ({"placement": {"profile": {"quantization": "int4"}, "forbiddenQuantizations": ["int4"]}}, "forbids"),
        ({"placement": {"forbiddenQuantizations": ["none", "int8", "int4"]}}, "every quantization"),
        ({"placement": {"allowedPools": ["a"], "preferredPools": ["b"]}}, "outside allowedPools"),
        ({"placement": {"profile": {"device": "cpu", "dtype": "fp16"}}}, "fp16"),
        ({"placement": {"maxGpusPerReplica": 3}}, "maxGpusPerReplica"),
        ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "exceeds maxReplicas"),
        ({"autoscaling": {"minReplicas": 0}}, "scaleToZero"),
        ({"autoscaling": {"mode": "magic"}}, "mode"),
        ({"engine": {"blockSize": 12}}, "blockSize"),
        ({"engine": {"kvCacheDtype": "int8"}}, "kvCacheDtype"),
        ({"replicas": -1}, "negative"),
        ({"apiKeySecretRef": {"key": "k"}}, "apiKeySecretRef.name"),
        ({"model": {"size": {"numHeads": 10, "numKVHeads": 4}}}, r"numKVHeads \(4\) must divide .*numHeads \(10\)"),
        ({"model": {"size": {"numHeads": 0}}}, "numHeads must be a positive integer"),
        ({"model": {"size": {"numHeads": "32"}}}, "numHeads must be a positive integer"),
        ({"model": {"size": {"numHeads": True}}}, "numHeads must be a positive integer"),
        ({"model": {"size": {"numKVHeads": -2}}}, "numKVHeads must be a positive integer"),
    ],
)
def test_spec_errors_name_the_field(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        parse_spec(raw)


def test_head_counts_parse() -> None:
    size = parse_spec({"model": {"size": {"numHeads": 32, "numKVHeads": 8}}}).model.size
    assert (size.num_heads, size.num_kv_heads) == (32, 8)
    assert parse_spec({}).model.size.num_heads is None
    size_schema = crd_schema()["properties"]["spec"]["properties"]["model"]["properties"]["size"]
    assert size_schema["properties"]["numHeads"]["minimum"] == 1


def test_autoscaling_fields_parse() -> None:
    spec = parse_spec(
        {
            "autoscaling": {
                "enabled": True,
                "mode": "keda",
                "minReplicas": 0,
                "maxReplicas": 10,
                "targetKVUtilization": 0.6,
                "targetWaitingRequests": 4,
                "scaleToZero": {"enabled": True, "idleSeconds": 120},
            }
        }
    )
    a = spec.autoscaling
    assert (a.enabled, a.mode, a.min_replicas, a.max_replicas, a.target_kv_utilization) == (True, "keda", 0, 10, 0.6)
    assert (a.target_waiting_requests, a.scale_to_zero, a.scale_to_zero_idle_s) == (4, True, 120)
