"""Spec parsing: defaults (in step with the CRD's), and the rules the schema cannot express."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from hpi_operator.spec import AutoscalingSpec, EngineSpec, InferenceSpec, SpecError, parse_parameter_count, parse_spec

CRD = Path(__file__).resolve().parents[2] / "crds" / "inferencedeployments.serving.hpi.dev.yaml"


def crd_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it (enough for this CRD: objects and scalars)."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = sub["default"]
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    return value


def test_empty_spec_is_the_embedded_model_with_one_replica() -> None:
    spec = parse_spec({})
    assert spec == InferenceSpec()
    assert spec.model.source == "embedded" and spec.replicas == 1


def test_server_defaulted_spec_parses_to_the_same_as_the_bare_one() -> None:
    for raw in ({}, {"autoscaling": {"enabled": True}}, {"placement": {"profile": {"dtype": "bf16"}}}):
        defaulted = apply_defaults(crd_spec_schema(), yaml.safe_load(yaml.safe_dump(raw)))
        assert parse_spec(defaulted) == parse_spec(raw), defaulted


def test_crd_defaults_match_the_dataclass_defaults() -> None:
    props = crd_spec_schema()["properties"]
    engine, autoscaling = props["engine"]["properties"], props["autoscaling"]["properties"]
    assert engine["maxModelLen"]["default"] == EngineSpec.max_model_len
    assert engine["maxNumSeqs"]["default"] == EngineSpec.max_num_seqs
    assert engine["kvCacheMemoryFraction"]["default"] == EngineSpec.kv_cache_memory_fraction
    assert engine["blockSize"]["default"] == EngineSpec.block_size
    defaults = AutoscalingSpec()
    assert autoscaling["targetKVUtilization"]["default"] == defaults.target_kv_utilization == 0.7
    assert autoscaling["minReplicas"]["default"] == defaults.min_replicas
    assert autoscaling["maxReplicas"]["default"] == defaults.max_replicas
    assert autoscaling["scaleDownStabilizationSeconds"]["default"] == defaults.scale_down_stabilization_s
    assert autoscaling["pollIntervalSeconds"]["default"] == defaults.poll_interval_s
    assert autoscaling["mode"]["enum"] == ["builtin", "hpa", "keda"]


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
    assert crd_spec_schema()["properties"]["model"]["properties"]["size"]["properties"]["numHeads"]["minimum"] == 1


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
