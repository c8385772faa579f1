"""Pure builders of the routing children: what stands between clients and the runtime pods (spec.routing.mode).

- `service`: one ClusterIP Service over every runtime pod, as before routing existed;
  kube-proxy spreads connections evenly, blind to each pool's speed.
- `router`: the runtime pods behind a headless Service `<name>-backends`; `hpi-router` (its own image,
  spec.routing.router.image: no torch, starts in a second) as a Deployment with a PodDisruptionBudget
  discovers them from that Service's EndpointSlices (its own ServiceAccount, Role and RoleBinding grant
  get/list/watch on endpointslices in the namespace, nothing more) and picks a backend
  per request by load; the user-facing Service `<name>` (the name clients already use) selects the router pods.
- `inferencePool`: an InferencePool (inference.networking.k8s.io/v1, the Gateway API inference extension) over
  the runtime pods, with the upstream endpoint picker (EPP) it needs; a Gateway's HTTPRoute points at the pool
  (docs/cluster-guide.md). The user-facing Service stays a plain ClusterIP Service for in-cluster clients.

Every routing child carries the InferenceDeployment's labels (children.prune finds them by those) and no
owner reference here; plan.py adopts them. Router and picker pods carry their own labels, never the runtime
selector: they must not count as runtime replicas (scale selector, PDB, autoscaler scrape targets).
"""

from __future__ import annotations

from typing import Any

from .manifests import (
    API_KEY_ENV,
    Owner,
    common_labels,
    container_security_context,
    pod_security_context,
    selector_labels,
    short_name,
)
from .names import (
    GROUP,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    OPERATOR_NAME,
    RUNTIME_PORT,
    RUNTIME_PORT_NAME,
)
from .spec import InferenceSpec

ROUTER_NAME = "hpi-router"
ROUTER_COMMAND = "hpi-router"  # the console script of router/pyproject.toml, on the router image's PATH
ROUTER_PORT = 8080
LABEL_ROUTER = f"{GROUP}/router"  # on router pods: which InferenceDeployment they route for
ENDPOINT_PICKER_NAME = "hpi-endpoint-picker"
LABEL_ENDPOINT_PICKER = f"{GROUP}/endpoint-picker"
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
# The endpoint picker's ports, as the upstream chart (config/charts/inferencepool) runs it.
EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT = 9002, 9003, 9090
DEFAULT_ROUTER_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
EPP_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
ROUTER_DRAIN_S = 30
TENANTS_MOUNT, TENANTS_FILE = "/etc/hpi/tenants", "tenants.yaml"  # where the router reads spec's tenants Secret


def backends_service_name(owner_name: str) -> str:
    return short_name(f"{owner_name}-backends")


def router_name(owner_name: str) -> str:
    return short_name(f"{owner_name}-router")


def endpoint_picker_name(owner_name: str) -> str:
    return short_name(f"{owner_name}-epp")


def _metadata(owner: Owner, name: str, component: str) -> dict[str, Any]:
    labels = {**common_labels(owner.name), LABEL_COMPONENT: component}
    return {"name": name, "namespace": owner.namespace, "labels": labels, "annotations": {}}


def _pod_labels(owner: Owner, app: str, component: str, key: str) -> dict[str, str]:
    return {LABEL_NAME: app, LABEL_INSTANCE: short_name(owner.name), LABEL_COMPONENT: component,
            LABEL_MANAGED_BY: OPERATOR_NAME, key: short_name(owner.name)}  # fmt: skip


def build_user_service(owner: Owner, selector: dict[str, str], target_port: str = RUNTIME_PORT_NAME) -> dict[str, Any]:
    """The ClusterIP Service clients call (`<name>:8000`), over `selector` (router pods or runtime pods)."""
    metadata = _metadata(owner, short_name(owner.name), "inference")
    port = {"name": RUNTIME_PORT_NAME, "port": RUNTIME_PORT, "targetPort": target_port, "protocol": "TCP"}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata,
            "spec": {"type": "ClusterIP", "selector": dict(selector), "ports": [port]}}  # fmt: skip


def build_backends_service(owner: Owner) -> dict[str, Any]:
    """A headless Service over the runtime pods: its EndpointSlices are the router's backend list.

    Not-ready pods stay out of the slices' ready set; the router sends only to ready addresses."""
    port = {"name": RUNTIME_PORT_NAME, "port": RUNTIME_PORT, "targetPort": RUNTIME_PORT_NAME, "protocol": "TCP"}
    metadata = _metadata(owner, backends_service_name(owner.name), "backends")
    spec = {"clusterIP": "None", "selector": selector_labels(owner.name), "ports": [port]}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec}


def _service_account(owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, name, component),
            "automountServiceAccountToken": False}  # fmt: skip


def _role(owner: Owner, name: str, component: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _metadata(owner, name, component), "rules": rules}  # fmt: skip


def _role_binding(owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(owner, name, component),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
    }


# What `hpi-router --discover-service` reads (router/hpi_router/discovery.py), and nothing else.
ROUTER_RULES = [
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
]
# What the upstream endpoint picker watches: the pool, its pods, and the objectives that name the pool.
ENDPOINT_PICKER_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
     "verbs": ["get", "list", "watch"]},
]  # fmt: skip


def _http_probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": RUNTIME_PORT_NAME}, "periodSeconds": period_s, "timeoutSeconds": 3,
            "failureThreshold": failures}  # fmt: skip


def _deployment(owner: Owner, name: str, component: str, pod_labels: dict[str, str], replicas: int,
                pod_spec: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    selector = {k: v for k, v in pod_labels.items() if k.startswith(f"{GROUP}/")}
    pod_spec = {
        **pod_spec,
        "serviceAccountName": name,
        "automountServiceAccountToken": True,  # both read the API: the router its slices, the picker its pods
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": dict(selector)}}],
    }  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, name, component),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def router_pod_labels(owner: Owner) -> dict[str, str]:
    return _pod_labels(owner, ROUTER_NAME, "router", LABEL_ROUTER)


def router_args(owner: Owner, spec: InferenceSpec) -> list[str]:
    """Arguments of `hpi-router` (router/hpi_router/cli.py)."""
    args = ["--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--discover-service", backends_service_name(owner.name), "--namespace", owner.namespace,
            "--discover-port", RUNTIME_PORT_NAME, "--drain-timeout", str(ROUTER_DRAIN_S)]  # fmt: skip
    if spec.routing.tenants_secret:
        # Each replica enforces its share of every tenant's limits (the Deployment's replicas are spec's: the
        # operator's apply reverts a hand scale, so the count stays true).
        args += ["--tenants-file", f"{TENANTS_MOUNT}/{TENANTS_FILE}",
                 "--router-replicas", str(spec.routing.router_replicas)]
    return args


def _tenants(spec: InferenceSpec, container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """The tenants Secret as a volume (not subPath: the kubelet then updates the file in place and the router
    re-reads it), and the pods' key, which the router presents to them once it checks tenants' keys itself."""
    ref = spec.routing.tenants_secret
    if ref is None:
        return
    pod_spec["volumes"].append({"name": "tenants", "secret": {"secretName": ref.name, "defaultMode": 0o400,
                                                              "items": [{"key": ref.key, "path": TENANTS_FILE}]}})
    container["volumeMounts"].append({"name": "tenants", "mountPath": TENANTS_MOUNT, "readOnly": True})
    if spec.api_key_secret:
        key = {"name": spec.api_key_secret.name, "key": spec.api_key_secret.key}
        container["env"] = [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": key}}]


def build_router_deployment(owner: Owner, spec: InferenceSpec) -> dict[str, Any]:
    container = {
        "name": "router",
        "image": spec.routing.router_image,
        # One registry for both images in practice: the runtime's pull policy and secrets serve the router too.
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": [ROUTER_COMMAND],
        "args": router_args(owner, spec),
        "ports": [{"name": RUNTIME_PORT_NAME, "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "resources": dict(spec.routing.router_resources) or DEFAULT_ROUTER_RESOURCES,
        "readinessProbe": _http_probe("/ready", 5, 2),
        "livenessProbe": _http_probe("/health", 10, 3),
        # Endpoints controllers drop the pod before the router stops taking requests, then it drains.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
        "terminationGracePeriodSeconds": 5 + ROUTER_DRAIN_S + 10,
    }
    _tenants(spec, container, pod_spec)
    if spec.runtime.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.runtime.image_pull_secrets]
    labels = router_pod_labels(owner)
    deployment = _deployment(owner, router_name(owner.name), "router", labels, spec.routing.router_replicas, pod_spec)
    deployment["spec"]["template"]["metadata"]["annotations"] = {
        "prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT), "prometheus.io/path": "/metrics",
    }  # fmt: skip
    return deployment


def build_router_pdb(owner: Owner) -> dict[str, Any]:
    """At most one router pod evicted at a time: with two replicas one always answers."""
    selector = {LABEL_ROUTER: short_name(owner.name)}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner, router_name(owner.name), "router"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}  # fmt: skip


def router_children(owner: Owner, spec: InferenceSpec) -> list[dict[str, Any]]:
    name = router_name(owner.name)
    return [
        build_backends_service(owner),
        _service_account(owner, name, "router"),
        _role(owner, name, "router", ROUTER_RULES),
        _role_binding(owner, name, "router"),
        build_router_deployment(owner, spec),
        build_router_pdb(owner),
        build_user_service(owner, {LABEL_ROUTER: short_name(owner.name)}),
    ]


def build_inference_pool(owner: Owner, spec: InferenceSpec) -> dict[str, Any]:
    """An InferencePool over the runtime pods; its endpoint picker is the `<name>-epp` Service's gRPC port."""
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": _metadata(owner, short_name(owner.name), "inference"),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "targetPorts": [{"number": RUNTIME_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": endpoint_picker_name(owner.name),
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": spec.routing.failure_mode,
            },
        },
    }


def build_endpoint_picker(owner: Owner, spec: InferenceSpec) -> dict[str, Any]:
    """The upstream endpoint picker for one pool: it scrapes the runtime pods' vllm: gauges and answers the
    gateway's ext-proc calls with the pod to use."""
    grpc_health = {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"}}
    container = {
        "name": "epp",
        "image": spec.routing.endpoint_picker_image,
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "--pool-name",
            short_name(owner.name),
            "--pool-namespace",
            owner.namespace,
            "--grpc-port",
            str(EPP_GRPC_PORT),
            "--grpc-health-port",
            str(EPP_HEALTH_PORT),
            "--metrics-port",
            str(EPP_METRICS_PORT),
            "--zap-encoder",
            "json",
        ],  # fmt: skip
        "ports": [
            {"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],  # fmt: skip
        "resources": EPP_RESOURCES,
        "readinessProbe": {**grpc_health, "periodSeconds": 5},
        "livenessProbe": {**grpc_health, "initialDelaySeconds": 5, "periodSeconds": 10},
        "securityContext": container_security_context(),
    }
    labels = _pod_labels(owner, ENDPOINT_PICKER_NAME, "endpoint-picker", LABEL_ENDPOINT_PICKER)
    # One replica: the upstream picker keeps per-pod state in memory and runs active-passive at best.
    return _deployment(owner, endpoint_picker_name(owner.name), "endpoint-picker", labels, 1,
                       {"containers": [container], "terminationGracePeriodSeconds": 30})  # fmt: skip


def build_endpoint_picker_service(owner: Owner) -> dict[str, Any]:
    port = {"name": "grpc", "port": EPP_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "http2"}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(owner, endpoint_picker_name(owner.name), "endpoint-picker"),
            "spec": {"type": "ClusterIP", "selector": {LABEL_ENDPOINT_PICKER: short_name(owner.name)},
                     "ports": [port]}}  # fmt: skip


def inference_pool_children(owner: Owner, spec: InferenceSpec) -> list[dict[str, Any]]:
    name = endpoint_picker_name(owner.name)
    return [
        build_inference_pool(owner, spec),
        _service_account(owner, name, "endpoint-picker"),
        _role(owner, name, "endpoint-picker", ENDPOINT_PICKER_RULES),
        _role_binding(owner, name, "endpoint-picker"),
        build_endpoint_picker(owner, spec),
        build_endpoint_picker_service(owner),
        build_user_service(owner, selector_labels(owner.name)),
    ]


def routing_children(owner: Owner, spec: InferenceSpec, mode: str) -> list[dict[str, Any]]:
    """Every routing child for `mode` (the effective one: spec.effective_routing_mode); the user-facing
    Service `<name>` is always among them."""
    if mode == "router":
        return router_children(owner, spec)
    if mode == "inferencePool":
        return inference_pool_children(owner, spec)
    return [build_user_service(owner, selector_labels(owner.name))]
