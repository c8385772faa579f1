"""What the API server does to a built-in object on every write, for the kinds the operator writes: decode
(nulls dropped, quantities canonical), default, and refuse changes to immutable fields.

Defaults are not in the published OpenAPI, so each one here is taken from Kubernetes' defaulting code and
cited by file (k8s.io/kubernetes at the SCHEMA_VERSION release): only the fields the operator's objects meet.
Fields the registry fills on create (a Service's clusterIP, a Job's selector and its controller-uid labels) are
set too, with made-up but well-formed values. Immutable fields come from each kind's validation
(pkg/apis/*/validation) and answer 422 with the API server's message shape:
`Deployment.apps "x" is invalid: spec.selector: Invalid value: ...: field is immutable`.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hpi_testing.k8s_openapi import Schema
from hpi_testing.quantity import QuantityError, canonical

# -- decoding -----------------------------------------------------------------------------------------------


def normalise(obj: Any, schema: Schema | None, path: str = "") -> Any:
    """`obj` as the API server decodes and re-encodes it: nulls dropped (typed fields are pointers or omitempty)
    and quantities in canonical form (quantity.py). Raises FieldError for a value that is not a quantity."""
    if schema is not None and schema.is_quantity and obj is not None:
        try:
            return canonical(obj)
        except QuantityError as e:
            raise FieldError(path.lstrip("."), obj, str(e)) from e
    if isinstance(obj, dict):
        return {k: normalise(v, schema.field(k) if schema else None, f"{path}.{k}")
                for k, v in obj.items() if v is not None}  # fmt: skip
    if isinstance(obj, list):
        item = schema.items() if schema else None
        return [normalise(v, item, f"{path}[{i}]") for i, v in enumerate(obj)]
    return obj


# -- defaulting ---------------------------------------------------------------------------------------------


def _container(c: dict[str, Any]) -> None:
    # pkg/apis/core/v1/defaults.go SetDefaults_Container: "Always" for the latest tag (or none), else IfNotPresent.
    image = c.get("image") or ""
    tagged = ":" in image.rsplit("/", 1)[-1] or "@" in image
    if "imagePullPolicy" not in c:
        c["imagePullPolicy"] = "IfNotPresent" if tagged and not image.endswith(":latest") else "Always"
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    for port in c.get("ports") or []:
        port.setdefault("protocol", "TCP")  # SetDefaults_ContainerPort
    for env in c.get("env") or []:
        field_ref = (env.get("valueFrom") or {}).get("fieldRef")
        if field_ref is not None:
            field_ref.setdefault("apiVersion", "v1")  # SetDefaults_ObjectFieldSelector
    for name in ("livenessProbe", "readinessProbe", "startupProbe"):
        if name in c:
            _probe(c[name])


def _probe(p: dict[str, Any]) -> None:
    # SetDefaults_Probe and SetDefaults_HTTPGetAction.
    for key, value in (("timeoutSeconds", 1), ("periodSeconds", 10), ("successThreshold", 1), ("failureThreshold", 3)):
        p.setdefault(key, value)
    if "httpGet" in p:
        p["httpGet"].setdefault("path", "/")
        p["httpGet"].setdefault("scheme", "HTTP")


def _pod_spec(spec: dict[str, Any], restart_policy: str | None = "Always") -> None:
    # SetDefaults_PodSpec (restartPolicy is not defaulted in a Job's template: validation requires it there).
    spec.setdefault("dnsPolicy", "ClusterFirst")
    if restart_policy:
        spec.setdefault("restartPolicy", restart_policy)
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        _container(c)
    for volume in spec.get("volumes") or []:
        _volume(volume)


def _volume(v: dict[str, Any]) -> None:
    # SetDefaults_Volume: no source means an emptyDir; SetDefaults_{Secret,ConfigMap,Projected}VolumeSource.
    if set(v) == {"name"}:
        v["emptyDir"] = {}
    for source in ("secret", "configMap", "projected"):
        if source in v:
            v[source].setdefault("defaultMode", 0o644)


def _deployment(obj: dict[str, Any]) -> None:
    # pkg/apis/apps/v1/defaults.go SetDefaults_Deployment.
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    strategy = spec.setdefault("strategy", {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        rolling.setdefault("maxUnavailable", "25%")
        rolling.setdefault("maxSurge", "25%")
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    _pod_spec(spec.setdefault("template", {}).setdefault("spec", {}))


def _service(obj: dict[str, Any]) -> None:
    # pkg/apis/core/v1/defaults.go SetDefaults_Service; clusterIP and ipFamilies come from the registry's
    # allocation on create (pkg/registry/core/service/storage).
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    if spec["type"] in ("ClusterIP", "NodePort", "LoadBalancer"):
        spec.setdefault("internalTrafficPolicy", "Cluster")
        if "clusterIP" not in spec:  # any free address will do: one derived from the name, stable across tests
            host = zlib.crc32(json.dumps(obj.get("metadata", {}).get("name")).encode()) % 60000
            spec["clusterIP"] = f"10.96.{host // 250}.{host % 250 + 2}"
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")


def _job(obj: dict[str, Any]) -> None:
    # pkg/apis/batch/v1/defaults.go SetDefaults_Job; the selector and its labels: pkg/registry/batch/job/strategy.go.
    spec = obj.setdefault("spec", {})
    if "completions" not in spec and "parallelism" not in spec:
        spec["completions"], spec["parallelism"] = 1, 1
    spec.setdefault("parallelism", 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
    template = spec.setdefault("template", {})
    _pod_spec(template.setdefault("spec", {}), restart_policy=None)
    uid = (obj.get("metadata") or {}).get("uid")
    if uid and "selector" not in spec:
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        labels = template.setdefault("metadata", {}).setdefault("labels", {})
        labels.update({"batch.kubernetes.io/controller-uid": uid, "controller-uid": uid,
                       "batch.kubernetes.io/job-name": obj["metadata"]["name"], "job-name": obj["metadata"]["name"]})


def _pvc(obj: dict[str, Any]) -> None:
    obj.setdefault("spec", {}).setdefault("volumeMode", "Filesystem")  # SetDefaults_PersistentVolumeClaimSpec


def _hpa(obj: dict[str, Any]) -> None:
    # pkg/apis/autoscaling/v2/defaults.go SetDefaults_HorizontalPodAutoscaler and ..._HorizontalPodAutoscalerBehavior.
    spec = obj.setdefault("spec", {})
    spec.setdefault("minReplicas", 1)
    if not spec.get("metrics"):
        target = {"type": "Utilization", "averageUtilization": 80}
        spec["metrics"] = [{"type": "Resource", "resource": {"name": "cpu", "target": target}}]
    behavior = spec.get("behavior")
    if behavior is not None:
        up = behavior.setdefault("scaleUp", {})
        up.setdefault("stabilizationWindowSeconds", 0)
        up.setdefault("selectPolicy", "Max")
        up.setdefault("policies", [{"type": "Pods", "value": 4, "periodSeconds": 15},
                                   {"type": "Percent", "value": 100, "periodSeconds": 15}])  # fmt: skip
        down = behavior.setdefault("scaleDown", {})
        down.setdefault("stabilizationWindowSeconds", 300)
        down.setdefault("selectPolicy", "Max")
        down.setdefault("policies", [{"type": "Percent", "value": 100, "periodSeconds": 15}])


def _role_binding(obj: dict[str, Any]) -> None:
    # pkg/apis/rbac/v1/defaults.go SetDefaults_Subject.
    for subject in obj.get("subjects") or []:
        if subject.get("kind") == "ServiceAccount":
            subject.setdefault("apiGroup", "")
        else:
            subject.setdefault("apiGroup", "rbac.authorization.k8s.io")


_DEFAULTERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "Deployment": _deployment,
    "Service": _service,
    "Job": _job,
    "PersistentVolumeClaim": _pvc,
    "HorizontalPodAutoscaler": _hpa,
    "RoleBinding": _role_binding,
}


def apply_defaults(obj: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(obj))
    defaulter = _DEFAULTERS.get(str(out.get("kind")))
    if defaulter is not None:
        defaulter(out)
    return out


# -- immutable fields ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldError(Exception):
    """One field the API server refuses (a `causes` entry of the 422 Status)."""

    field: str
    value: Any
    detail: str
    reason: str = "FieldValueInvalid"

    def __str__(self) -> str:
        if self.reason == "FieldValueForbidden":
            return f"{self.field}: Forbidden: {self.detail}"
        return f"{self.field}: Invalid value: {json.dumps(self.value, sort_keys=True)}: {self.detail}"


def _get(obj: Mapping[str, Any], *path: str) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj


def _immutable(old: Mapping[str, Any], new: Mapping[str, Any], *path: str) -> list[FieldError]:
    before, after = _get(old, *path), _get(new, *path)
    return [] if before == after else [FieldError(".".join(path), after, "field is immutable")]


def immutable_errors(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[FieldError]:
    """The changes of `old` -> `new` (both defaulted) that the kind's update validation refuses."""
    kind = new.get("kind")
    if kind == "Deployment":  # pkg/apis/apps/validation ValidateDeploymentUpdate (apps/v1)
        return _immutable(old, new, "spec", "selector")
    if kind == "Job":  # pkg/apis/batch/validation ValidateJobSpecUpdate
        return _immutable(old, new, "spec", "selector") + _immutable(old, new, "spec", "template")
    if kind == "Service":  # pkg/apis/core/validation ValidateServiceUpdate: a set clusterIP stays
        if _get(old, "spec", "clusterIP") and _get(new, "spec", "clusterIP") != _get(old, "spec", "clusterIP"):
            return _immutable(old, new, "spec", "clusterIP")
        return []
    if kind == "PersistentVolumeClaim":  # ValidatePersistentVolumeClaimUpdate
        return _pvc_update(old, new)
    return []


def _pvc_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[FieldError]:
    from hpi_testing.quantity import parse

    def without_requests(obj: Mapping[str, Any]) -> Any:
        spec = copy.deepcopy(dict(_get(obj, "spec") or {}))
        (spec.get("resources") or {}).pop("requests", None)
        spec.pop("volumeAttributesClassName", None)
        return spec

    if without_requests(old) != without_requests(new):
        return [FieldError("spec", None, "spec is immutable after creation except resources.requests and "
                           "volumeAttributesClassName for bound claims", reason="FieldValueForbidden")]  # fmt: skip
    before = _get(old, "spec", "resources", "requests", "storage")
    after = _get(new, "spec", "resources", "requests", "storage")
    if before and after and parse(after)[0] < parse(before)[0]:
        return [FieldError("spec.resources.requests.storage", after, "field can not be less than previous value",
                           reason="FieldValueForbidden")]  # fmt: skip
    return []
