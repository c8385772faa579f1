"""The HPA (mode hpa) and KEDA ScaledObject (mode keda) builders: schema-valid, aimed at the CR's scale
subresource, and carrying the same target, bounds, windows and step as the builtin scaler."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hpi_contracts.metrics import KV_CACHE_USAGE, NUM_REQUESTS_WAITING, ROUTER_QUEUED_REQUESTS
from hpi_operator.autoscaling.manifests import (
    ANNOTATION_PROMETHEUS_URL,
    HPA_KV_METRIC,
    HPA_WAITING_METRIC,
    autoscaler_child,
    build_autoscaler,
    build_hpa,
    build_scaled_object,
    milli,
)
from hpi_operator.manifests import Owner
from hpi_operator.names import ANNOTATION_SPEC_HASH
from hpi_operator.nodes import node_info
from hpi_operator.plan import make_plan
from hpi_operator.routing_manifests import router_name
from hpi_operator.spec import AutoscalingSpec, parse_spec
from hpi_testing.kube_emulator import make_node

from .conftest import CRD_PATH

OWNER = Owner("llama", "team-a")
SETTINGS = AutoscalingSpec(enabled=True, mode="hpa", min_replicas=2, max_replicas=10, target_kv_utilization=0.7,
                           scale_up_stabilization_s=0, scale_down_stabilization_s=300, max_scale_step=3,
                           poll_interval_s=15)  # fmt: skip
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())

# The parts of KEDA's ScaledObject CRD (keda.sh/v1alpha1, KEDA 2.x) the builder writes, with KEDA's types:
# trigger metadata is map[string]string, counts are int32, scaleTargetRef.name is required.
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "name": {"type": "string"}, "envSourceContainerName": {"type": "string"}},
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object"},
                "advanced": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"}, "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {"type": "object"},
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
}  # fmt: skip


def validate_hpa_behavior_via_k8s(behavior: dict[str, Any], version: str) -> None:
    hpa = build_hpa(OWNER, SETTINGS)
    hpa["spec"]["behavior"] = behavior
    kubernetes_validate.validate(hpa, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("waiting", [None, 4])
def test_hpa_is_valid_autoscaling_v2(version: str, waiting: int | None) -> None:
    hpa = build_hpa(OWNER, replace(SETTINGS, target_waiting_requests=waiting))
    kubernetes_validate.validate(hpa, version, strict=True)
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
                                      "name": "llama"}  # fmt: skip
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 10)
    [kv, *rest] = spec["metrics"]
    assert kv == {"type": "Pods", "pods": {"metric": {"name": HPA_KV_METRIC},
                                           "target": {"type": "AverageValue", "averageValue": "700m"}}}  # fmt: skip
    assert [m["pods"]["metric"]["name"] for m in rest] == ([HPA_WAITING_METRIC] if waiting else [])
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert spec["behavior"]["scaleUp"]["policies"] == [{"type": "Pods", "value": 3, "periodSeconds": 15}]
    assert hpa["metadata"]["namespace"] == "team-a"


def test_hpa_never_asks_for_zero() -> None:
    hpa = build_hpa(OWNER, replace(SETTINGS, min_replicas=0, scale_to_zero=True))
    assert hpa["spec"]["minReplicas"] == 1  # HPAScaleToZero is an alpha gate; keda does zero


def test_hpa_targets_the_scale_subresource_the_crd_declares() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["served"]]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    ref = build_hpa(OWNER, SETTINGS)["spec"]["scaleTargetRef"]
    assert ref["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
    assert ref["kind"] == crd["spec"]["names"]["kind"]


def test_quantities() -> None:
    assert [milli(v) for v in (0.7, 0.05, 1.0, 0.333)] == ["700m", "50m", "1000m", "333m"]


@pytest.mark.parametrize("settings", [
    replace(SETTINGS, mode="keda"),
    replace(SETTINGS, mode="keda", target_waiting_requests=8),
    replace(SETTINGS, mode="keda", min_replicas=0, scale_to_zero=True, scale_to_zero_idle_s=900),
    replace(SETTINGS, mode="keda", min_replicas=2, scale_to_zero=True),
], ids=["kv", "kv+waiting", "to-zero", "idle-to-zero"])  # fmt: skip
def test_scaled_object_structure(settings: AutoscalingSpec) -> None:
    obj = build_scaled_object(OWNER, settings, "meta-llama/Llama-3.1-8B-Instruct", "http://prom.monitoring:9090")
    jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)
    spec = obj["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
                                      "name": "llama"}  # fmt: skip
    kv = spec["triggers"][0]
    assert kv["type"] == "prometheus" and kv["metadata"]["threshold"] == "0.7"
    assert kv["metadata"]["serverAddress"] == "http://prom.monitoring:9090"
    query = kv["metadata"]["query"]
    assert query.startswith(f"sum({KV_CACHE_USAGE}{{") and 'namespace="team-a"' in query
    assert 'model_name="meta-llama/Llama-3.1-8B-Instruct"' in query
    assert spec["maxReplicaCount"] == 10 and spec["pollingInterval"] == 15
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
    # KEDA rule: idleReplicaCount, when set, must be below minReplicaCount.
    if "idleReplicaCount" in spec:
        assert spec["idleReplicaCount"] < spec["minReplicaCount"]
    if settings.scale_to_zero:
        assert min(spec["minReplicaCount"], spec.get("idleReplicaCount", 99)) == 0
        assert spec["cooldownPeriod"] == settings.scale_to_zero_idle_s
        assert any(NUM_REQUESTS_WAITING in t["metadata"]["query"] for t in spec["triggers"])  # the wake-up signal
    else:
        assert spec["minReplicaCount"] == 2 and "idleReplicaCount" not in spec
    # The HPA KEDA creates gets the same behavior the builtin scaler follows: valid autoscaling/v2 behavior.
    validate_hpa_behavior_via_k8s(spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
                                  kubernetes_validate.latest_version())  # fmt: skip


def test_build_autoscaler_by_mode_from_a_parsed_spec() -> None:
    def parsed(**autoscaling: Any) -> AutoscalingSpec:
        return parse_spec({"autoscaling": autoscaling}).autoscaling

    assert build_autoscaler(OWNER, parsed(enabled=False, mode="hpa"), "m") is None
    assert build_autoscaler(OWNER, parsed(enabled=True), "m") is None  # builtin: the operator itself
    optimizer = replace(parsed(enabled=True), mode="optimizer")  # (parse_spec wants spec.slo with it)
    assert build_autoscaler(OWNER, optimizer, "m") is None  # the operator's own timer, as builtin
    assert build_autoscaler(OWNER, parsed(enabled=True, mode="hpa"), "m")["kind"] == "HorizontalPodAutoscaler"
    keda = build_autoscaler(OWNER, parsed(enabled=True, mode="keda", targetKVUtilization=0.8), "m")
    assert keda["kind"] == "ScaledObject" and keda["spec"]["triggers"][0]["metadata"]["threshold"] == "0.8"


def test_autoscaler_child_is_adopted_and_stamped_like_the_other_children() -> None:
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "llama", "namespace": "team-a", "uid": "u-1",
                         "annotations": {ANNOTATION_PROMETHEUS_URL: "http://prom:9090"}},
            "spec": {"autoscaling": {"enabled": True, "mode": "keda"}}}  # fmt: skip
    spec = parse_spec(body["spec"])
    child = autoscaler_child(body, OWNER, spec, "service")
    [ref] = child["metadata"]["ownerReferences"]
    assert ref["uid"] == "u-1" and ref["kind"] == "InferenceDeployment" and ref["controller"] is True
    assert child["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    assert child["spec"]["triggers"][0]["metadata"]["serverAddress"] == "http://prom:9090"
    assert child["spec"]["triggers"][0]["metadata"]["query"].endswith('model_name="SmolLM2-135M-Instruct"})')
    offline = autoscaler_child({**body, "metadata": {"name": "llama"}}, OWNER, spec, "service")
    assert "ownerReferences" not in offline["metadata"]
    assert autoscaler_child(body, OWNER, parse_spec({}), "router") is None


@pytest.mark.parametrize("mode", ["router", "service", "inferencePool"])
@pytest.mark.parametrize("settings", [
    replace(SETTINGS, mode="keda"),
    replace(SETTINGS, mode="keda", min_replicas=0, scale_to_zero=True),
], ids=["kv", "to-zero"])  # fmt: skip
def test_the_routers_queue_is_a_trigger_only_in_router_mode(settings: AutoscalingSpec, mode: str) -> None:
    obj = build_scaled_object(OWNER, settings, "m", "http://prom:9090", routing_mode=mode)
    jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)
    queued = [t for t in obj["spec"]["triggers"] if ROUTER_QUEUED_REQUESTS in t["metadata"]["query"]]
    if mode != "router":
        assert not queued
        return
    [trigger] = queued
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["query"] == f'sum({ROUTER_QUEUED_REQUESTS}{{namespace="team-a",pod=~"{router_name("llama")}-.*"}})'
    assert (meta["threshold"], meta["activationThreshold"]) == ("1", "0")
    assert meta["serverAddress"] == "http://prom:9090"
    assert meta["ignoreNullValues"] == "true"  # an idle router exports the gauge with no sample
    assert len({t["name"] for t in obj["spec"]["triggers"]}) == len(obj["spec"]["triggers"])  # KEDA: unique names


def test_the_plan_gives_the_scaled_object_its_effective_routing_mode() -> None:
    """routing.mode unset: router for a resource that can scale past one replica, so the queue trigger is there."""
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "llama", "namespace": "team-a", "uid": "u-1"},
            "spec": {"autoscaling": {"enabled": True, "mode": "keda", "minReplicas": 0, "maxReplicas": 4,
                                     "scaleToZero": {"enabled": True}}}}  # fmt: skip
    nodes = [node_info(make_node("cpu-0", bf16=True))]
    routed = make_plan(body, nodes)
    assert routed.routing_mode == "router"
    assert any(ROUTER_QUEUED_REQUESTS in t["metadata"]["query"] for t in routed.autoscaler["spec"]["triggers"])
    body["spec"]["routing"] = {"mode": "service"}
    plain = make_plan(body, nodes)
    assert not any(ROUTER_QUEUED_REQUESTS in t["metadata"]["query"] for t in plain.autoscaler["spec"]["triggers"])
