"""Pure builders for the two external autoscaling modes: an autoscaling/v2 HorizontalPodAutoscaler (mode `hpa`)
and a KEDA ScaledObject (mode `keda`), both aimed at the InferenceDeployment's scale subresource.

Either way the scaler writes spec.replicas and the reconciler spreads it across pools, exactly as with the
builtin scaler. The HPA reads a Pods metric served by prometheus-adapter (the rule is in docs/autoscaling.md);
KEDA queries Prometheus itself. Children carry no owner references here; the caller adopts them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from hpi_contracts.metrics import KV_CACHE_USAGE, MODEL_NAME_LABEL, NUM_REQUESTS_WAITING, ROUTER_QUEUED_REQUESTS

from ..manifests import Owner, common_labels, served_model_name, short_name, stamp_hash
from ..names import API_VERSION, GROUP, KIND
from ..routing_manifests import router_name
from ..spec import AutoscalingSpec, InferenceSpec

# The custom-metrics API names prometheus-adapter gives the vLLM gauges (":" is not allowed there, so the
# adapter rule renames them; see docs/autoscaling.md).
HPA_KV_METRIC = KV_CACHE_USAGE.replace(":", "_")
HPA_WAITING_METRIC = NUM_REQUESTS_WAITING.replace(":", "_")
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
ANNOTATION_PROMETHEUS_URL = f"{GROUP}/prometheus-url"  # on the InferenceDeployment: overrides the above


def milli(value: float) -> str:
    """A resource.Quantity for a fraction: 0.7 -> "700m"."""
    return f"{round(value * 1000)}m"


def _scale_target(owner: Owner) -> dict[str, str]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name}


def hpa_behavior(settings: AutoscalingSpec) -> dict[str, Any]:
    """The builtin scaler's windows and step limit in the HPA's terms (one step per poll interval)."""

    def rules(window_s: float) -> dict[str, Any]:
        return {
            "stabilizationWindowSeconds": round(window_s),
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": settings.max_scale_step, "periodSeconds": settings.poll_interval_s}],
        }

    return {
        "scaleUp": rules(settings.scale_up_stabilization_s),
        "scaleDown": rules(settings.scale_down_window_s()),
    }


def _metadata(owner: Owner) -> dict[str, Any]:
    return {"name": short_name(owner.name), "namespace": owner.namespace, "labels": common_labels(owner.name),
            "annotations": {}}  # fmt: skip


def build_hpa(owner: Owner, settings: AutoscalingSpec) -> dict[str, Any]:
    """An autoscaling/v2 HPA on the InferenceDeployment: average KV utilisation per pod at the target.

    minReplicas is at least 1: an HPA only scales to zero behind the alpha HPAScaleToZero gate (use keda).
    """
    metrics: list[dict[str, Any]] = [{
        "type": "Pods",
        "pods": {
            "metric": {"name": HPA_KV_METRIC},
            "target": {"type": "AverageValue", "averageValue": milli(settings.target_kv_utilization)},
        },
    }]  # fmt: skip
    if settings.target_waiting_requests:
        metrics.append({
            "type": "Pods",
            "pods": {
                "metric": {"name": HPA_WAITING_METRIC},
                "target": {"type": "AverageValue", "averageValue": str(settings.target_waiting_requests)},
            },
        })  # fmt: skip
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(owner),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicas": max(settings.min_replicas, 1),
            "maxReplicas": settings.max_replicas,
            "metrics": metrics,
            "behavior": hpa_behavior(settings),
        },
    }


def _selector(owner: Owner, served_model: str) -> str:
    return f'namespace="{owner.namespace}",{MODEL_NAME_LABEL}="{served_model}"'


def _router_selector(owner: Owner) -> str:
    """The router pods' series: by namespace and pod name (the router's Deployment name and a dash, then the
    ReplicaSet's and the pod's hashes), the labels every Kubernetes pod scrape config keeps."""
    return f'namespace="{owner.namespace}",pod=~"{router_name(owner.name)}-.*"'


def build_scaled_object(
    owner: Owner,
    settings: AutoscalingSpec,
    served_model: str,
    prometheus_url: str = DEFAULT_PROMETHEUS_URL,
    routing_mode: str = "service",
) -> dict[str, Any]:
    """A keda.sh/v1alpha1 ScaledObject with a prometheus trigger on the summed KV utilisation.

    KEDA feeds the query's value to an HPA as an AverageValue metric: replicas = ceil(sum / threshold), the
    same proportional rule as the builtin scaler. Series are selected by namespace and model_name (the vLLM
    label), which every Prometheus scrape config keeps. With routing mode `router` (the effective one), a
    trigger on the requests the router pods hold: the one signal that exists while no runtime pod does.
    """
    selector = _selector(owner, served_model)
    triggers: list[dict[str, Any]] = [{
        "type": "prometheus",
        "name": "kv-cache-utilization",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": prometheus_url,
            "query": f"sum({KV_CACHE_USAGE}{{{selector}}})",
            "threshold": str(settings.target_kv_utilization),
            "activationThreshold": "0",
            "ignoreNullValues": "false",  # no series (Prometheus or pods gone) is an error, not zero load
        },
    }]  # fmt: skip
    if settings.target_waiting_requests or settings.scale_to_zero:
        # Waiting requests are also the wake-up signal from zero (any request queued activates the scaler).
        triggers.append({
            "type": "prometheus",
            "name": "waiting-requests",
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": prometheus_url,
                "query": f"sum({NUM_REQUESTS_WAITING}{{{selector}}})",
                "threshold": str(settings.target_waiting_requests or 1),
                "activationThreshold": "0",
                "ignoreNullValues": "true" if settings.scale_to_zero else "false",
            },
        })  # fmt: skip
    if routing_mode == "router":
        # Activation at any queued request wakes the resource from zero; at threshold 1 a held request asks for a
        # replica, bounded by the behavior's step per poll like the other triggers. An idle router exports the
        # gauge without samples (no flow yet), so no series reads as nothing queued, not as an error.
        triggers.append({
            "type": "prometheus",
            "name": "router-queued-requests",
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": prometheus_url,
                "query": f"sum({ROUTER_QUEUED_REQUESTS}{{{_router_selector(owner)}}})",
                "threshold": "1",
                "activationThreshold": "0",
                "ignoreNullValues": "true",
            },
        })  # fmt: skip
    spec: dict[str, Any] = {
        "scaleTargetRef": _scale_target(owner),
        "pollingInterval": settings.poll_interval_s,
        "cooldownPeriod": settings.scale_to_zero_idle_s,
        # Zero only with scaleToZero: then KEDA deactivates after cooldownPeriod without activity.
        "minReplicaCount": settings.min_replicas if settings.scale_to_zero else max(settings.min_replicas, 1),
        "maxReplicaCount": settings.max_replicas,
        "advanced": {
            "horizontalPodAutoscalerConfig": {
                "name": short_name(f"keda-hpa-{owner.name}"),
                "behavior": hpa_behavior(settings),
            }
        },  # fmt: skip
        "triggers": triggers,
    }
    if settings.scale_to_zero and settings.min_replicas > 0:
        spec["idleReplicaCount"] = 0  # KEDA: 0 when idle, else at least minReplicaCount
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(owner),
        "spec": spec,
    }


def build_autoscaler(
    owner: Owner,
    settings: AutoscalingSpec,
    served_model: str,
    prometheus_url: str = DEFAULT_PROMETHEUS_URL,
    routing_mode: str = "service",
) -> dict[str, Any] | None:
    """The child the spec asks for: an HPA, a ScaledObject, or None (builtin or optimizer: the operator's own
    timer scales; or autoscaling disabled)."""
    if not settings.enabled or settings.mode in ("builtin", "optimizer"):
        return None
    if settings.mode == "hpa":
        return build_hpa(owner, settings)
    return build_scaled_object(owner, settings, served_model, prometheus_url, routing_mode)


def autoscaler_child(body: Mapping[str, Any], owner: Owner, spec: InferenceSpec, routing_mode: str
                     ) -> dict[str, Any] | None:  # fmt: skip
    """The HPA or ScaledObject for the resource `body`, adopted (owner reference) and hash-stamped like the
    other children, or None when the spec asks for neither; `routing_mode`: the effective one (the plan's). The
    Prometheus address may be overridden per resource with the `serving.hpi.dev/prometheus-url` annotation."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    url = annotations.get(ANNOTATION_PROMETHEUS_URL) or DEFAULT_PROMETHEUS_URL
    child = build_autoscaler(owner, spec.autoscaling, served_model_name(owner.name, spec), url, routing_mode)
    if child is None:
        return None
    if (body.get("metadata") or {}).get("uid"):  # an offline render of a CR never created has no owner
        kopf.adopt(child, owner=dict(body))
    return stamp_hash(child)
