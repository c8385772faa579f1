"""spec.routing: the default mode and the routing children of each mode, as pure manifests and under the real
kopf operator against the API emulator over HTTP (mode switches prune the objects of the mode left; a bad
routing spec is a Degraded condition and a Warning Event).

The InferencePool is checked against the published v1 schema (tests/operator/data, with its source); the
other children against Kubernetes' own schemas (kubernetes-validate --strict); the router's command line
against the runtime's own argument parser.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hpi_operator.kube import KubeClient, KubeError
from hpi_operator.nodes import node_info
from hpi_operator.plan import Plan, make_plan
from hpi_operator.rbac import RULES
from hpi_operator.spec import SpecError
from hpi_testing.kube_emulator import L4, eventually, make_node


def _to_json_schema() -> Any:
    """test_crd.py's OpenAPI -> JSON Schema mapping (tests/operator is no package: loaded by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hpi_test_crd", Path(__file__).with_name("test_crd.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.to_json_schema


to_json_schema = _to_json_schema()
POOL_SCHEMA = yaml.safe_load((Path(__file__).parent / "data" / "inferencepool-v1-schema.yaml").read_text())
ONE_POOL = [node_info(make_node("c", bf16=True))]
TWO_POOLS = [node_info(make_node("c", bf16=True)), node_info(make_node("g", gpu=L4))]
RUNTIME_SELECTOR = {"serving.hpi.dev/inference-deployment": "demo"}


def plan(spec: dict[str, Any], nodes: list[Any] = TWO_POOLS) -> Plan:
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1"}, "spec": spec}  # fmt: skip
    return make_plan(body, nodes)


def by_kind(p: Plan, kind: str) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["name"]: c for c in p.children if c["kind"] == kind}


def validate_pool(pool: dict[str, Any]) -> None:
    jsonschema.validate(pool, to_json_schema(POOL_SCHEMA), cls=jsonschema.Draft7Validator)
    ref = pool["spec"]["endpointPickerRef"]  # the schema's CEL rule, which JSON Schema cannot say
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))


@pytest.mark.parametrize(
    ("spec", "nodes", "mode"),
    [
        ({"replicas": 1}, ONE_POOL, "service"),  # one replica: nothing to balance
        ({"replicas": 2}, ONE_POOL, "router"),
        ({"replicas": 3}, TWO_POOLS, "router"),
        ({"replicas": 1, "autoscaling": {"enabled": True, "maxReplicas": 4}}, ONE_POOL, "router"),
        ({"replicas": 3, "routing": {"mode": "service"}}, TWO_POOLS, "service"),
        ({"replicas": 1, "routing": {"mode": "inferencePool"}}, ONE_POOL, "inferencePool"),
    ],
)
def test_default_mode_follows_what_can_run_more_than_one_replica(spec, nodes, mode) -> None:
    assert plan(spec, nodes).routing_mode == mode


def test_router_mode_children() -> None:
    p = plan({"replicas": 3})
    services = by_kind(p, "Service")
    assert services["demo-backends"]["spec"]["clusterIP"] == "None"
    assert services["demo-backends"]["spec"]["selector"] == RUNTIME_SELECTOR
    assert p.service["metadata"]["name"] == "demo"  # the name clients already use ...
    assert p.service["spec"]["selector"] == {"serving.hpi.dev/router": "demo"}  # ... now reaches the router
    router = by_kind(p, "Deployment")["demo-router"]
    pod = router["spec"]["template"]
    # Router pods are no runtime replicas: outside the scale selector, the runtime PDB and the backends.
    assert not RUNTIME_SELECTOR.items() <= pod["metadata"]["labels"].items()
    assert p.service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert router["spec"]["replicas"] == 2
    [container] = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["securityContext"]["readOnlyRootFilesystem"] and pod["spec"]["securityContext"]["runAsNonRoot"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert pod["spec"]["serviceAccountName"] == "demo-router"
    from hpi_router.cli import build_parser  # the router's flags are the contract

    assert container["command"] == ["hpi-router"] and container["image"] == "ghcr.io/hetero-paged-infer/router:0.1.0"
    args, unknown = build_parser().parse_known_args(container["args"])
    assert unknown == []
    assert (args.discover_service, args.namespace, args.discover_port) == ("demo-backends", "ml", "http")
    assert container["ports"][0]["containerPort"] == args.port
    [rule] = by_kind(p, "Role")["demo-router"]["rules"]
    assert rule == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}  # fmt: skip
    binding = by_kind(p, "RoleBinding")["demo-router"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-router", "namespace": "ml"}]
    assert binding["roleRef"]["name"] == "demo-router"
    budget = by_kind(p, "PodDisruptionBudget")["demo-router"]
    assert budget["spec"]["selector"]["matchLabels"] == p.service["spec"]["selector"]
    for child in p.children:
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        kubernetes_validate.validate(child, kubernetes_validate.latest_version(), strict=True)


def test_router_pods_run_the_router_image_from_the_spec() -> None:
    spec = {"replicas": 2, "runtime": {"imagePullSecrets": [{"name": "regcred"}]},
            "routing": {"router": {"image": "registry.example.com/hpi/router:0.2.0"}}}  # fmt: skip
    pod = by_kind(plan(spec), "Deployment")["demo-router"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example.com/hpi/router:0.2.0"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]  # one registry: the runtime's secrets serve it too


def test_inference_pool_mode_children_validate_against_the_published_schema() -> None:
    p = plan({"replicas": 3, "routing": {"mode": "inferencePool", "inferencePool": {"failureMode": "FailClose"}}})
    [pool] = by_kind(p, "InferencePool").values()
    validate_pool(pool)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"] == RUNTIME_SELECTOR
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    picker_service = by_kind(p, "Service")[ref["name"]]
    assert [port["port"] for port in picker_service["spec"]["ports"]] == [ref["port"]["number"]]
    picker = by_kind(p, "Deployment")["demo-epp"]
    assert picker_service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert args[args.index("--pool-namespace") + 1] == "ml"
    assert p.service["spec"]["selector"] == RUNTIME_SELECTOR  # in-cluster clients keep a plain Service
    for child in p.children:
        if child["kind"] != "InferencePool":
            kubernetes_validate.validate(child, kubernetes_validate.latest_version(), strict=True)
    with pytest.raises(jsonschema.ValidationError):  # the schema check can fail
        validate_pool({**pool, "spec": {**pool["spec"], "targetPorts": []}})


def test_the_operator_holds_every_verb_its_roles_grant() -> None:
    """RBAC escalation prevention: a Role can only grant what its creator holds."""
    for mode in ("router", "inferencePool"):
        for role in by_kind(plan({"replicas": 2, "routing": {"mode": mode}}), "Role").values():
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            assert any(r.allows(group, resource, verb) for r in RULES), (group, resource, verb)


def test_tenants_mount_the_secret_and_the_router_reads_it_and_presents_the_pods_key(tmp_path) -> None:
    spec = {"replicas": 1, "apiKeySecretRef": {"name": "pod-key"},
            "routing": {"router": {"tenantsSecretRef": {"name": "team-keys"}}}}  # fmt: skip
    p = plan(spec)
    assert p.service["spec"]["selector"] == {"serving.hpi.dev/router": "demo"}  # one replica, but tenants: router
    router = by_kind(p, "Deployment")["demo-router"]
    pod = router["spec"]["template"]["spec"]
    [container] = pod["containers"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tenants")
    assert volume["secret"]["secretName"] == "team-keys" and "subPath" not in str(container["volumeMounts"])
    assert volume["secret"]["items"] == [{"key": "tenants.yaml", "path": "tenants.yaml"}]  # the CRD's default key
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tenants")
    assert mount["readOnly"] and container["env"] == [
        {"name": "HPI_API_KEY", "valueFrom": {"secretKeyRef": {"name": "pod-key", "key": "api-key"}}}]
    from hpi_router.cli import build_parser, settings_from_args  # the router's flags are the contract
    from hpi_router.tenants import TenantsFile

    args, unknown = build_parser().parse_known_args(container["args"])
    assert unknown == [] and args.tenants_file == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    assert settings_from_args(args).tenants_file == args.tenants_file
    assert settings_from_args(args).num_replicas == 2  # the CRD's default router replicas: each enforces half
    three = by_kind(plan({**spec, "routing": {"router": {**spec["routing"]["router"], "replicas": 3}}}), "Deployment")
    assert settings_from_args(build_parser().parse_args(
        three["demo-router"]["spec"]["template"]["spec"]["containers"][0]["args"])).num_replicas == 3
    local = tmp_path / "tenants.yaml"  # what the router does with the file at that path
    local.write_text("tenants: [{name: a, keys: [sk-0123456789abcdef0]}]")
    assert TenantsFile(local).ring.num_keys == 1
    kubernetes_validate.validate(router, kubernetes_validate.latest_version(), strict=True)
    with pytest.raises(SpecError, match="tenantsSecretRef needs routing mode router"):
        plan({**spec, "routing": {"mode": "service", "router": {"tenantsSecretRef": {"name": "team-keys"}}}})
    with pytest.raises(SpecError, match="tenantsSecretRef.name is required"):
        plan({**spec, "routing": {"router": {"tenantsSecretRef": {"key": "x"}}}})


@pytest.mark.parametrize(
    ("routing", "message"),
    [
        ({"mode": "roundRobin"}, "spec.routing.mode must be one of router, inferencePool, service"),
        ({"router": {"replicas": 0}}, "spec.routing.router.replicas must be a positive integer"),
        ({"router": {"image": " "}}, "spec.routing.router.image must not be empty"),
        ({"inferencePool": {"failureMode": "Open"}}, "spec.routing.inferencePool.failureMode"),
    ],
)
def test_bad_routing_input_is_a_spec_error(routing, message) -> None:
    with pytest.raises(SpecError, match=message):
        plan({"replicas": 2, "routing": routing})


# -- under the operator ---------------------------------------------------------------------------------------

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
SERVICES = f"/api/v1/namespaces/{NS}/services"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
ROLES = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles"
ROUTING_KINDS = {  # what each mode owns beyond the runtime Deployments and their PDB
    "router": {f"{SERVICES}/mix-backends", f"{DEPLOYMENTS}/mix-router", f"{ROLES}/mix-router",
               f"/api/v1/namespaces/{NS}/serviceaccounts/mix-router",
               f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/mix-router",
               f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/mix-router"},
    "inferencePool": {f"{POOLS}/mix", f"{DEPLOYMENTS}/mix-epp", f"{SERVICES}/mix-epp", f"{ROLES}/mix-epp",
                      f"/api/v1/namespaces/{NS}/serviceaccounts/mix-epp",
                      f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/mix-epp"},
    "service": set(),
}  # fmt: skip


async def call(kube: KubeClient, method: str, path: str, body: Any = None, merge: bool = False) -> Any:
    content_type = "application/merge-patch+json" if merge else "application/json"
    return await asyncio.to_thread(kube.request, method, path, body, content_type)


def present(kube: KubeClient) -> dict[str, set[str]]:
    """Which routing objects of each mode exist now."""
    return {mode: {path for path in paths if kube.get(path)} for mode, paths in ROUTING_KINDS.items()}


def only(mode: str):
    def check(kube: KubeClient) -> bool:
        found = present(kube)
        return found[mode] == ROUTING_KINDS[mode] and not any(found[m] for m in ROUTING_KINDS if m != mode)

    return check


@pytest.mark.slow
async def test_modes_build_and_prune_their_routing_objects(kube: KubeClient, operator: Any) -> None:
    await call(kube, "POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    await call(kube, "POST", "/api/v1/nodes", make_node("gpu-0", gpu=L4))
    created = await call(
        kube,
        "POST",
        CRS,
        {
            "apiVersion": "serving.hpi.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "mix", "namespace": NS},
            "spec": {"replicas": 3},
        },
    )

    # Two pools, no mode set: the router, and the Service clients use points at it.
    await eventually(lambda: only("router")(kube))
    service = await asyncio.to_thread(kube.get, f"{SERVICES}/mix")
    assert service["spec"]["selector"] == {"serving.hpi.dev/router": "mix"}
    for path in ROUTING_KINDS["router"] | {f"{SERVICES}/mix"}:
        [ref] = (await asyncio.to_thread(kube.get, path))["metadata"]["ownerReferences"]
        assert ref["uid"] == created["metadata"]["uid"] and ref["controller"] is True
    headless = await asyncio.to_thread(kube.get, f"{SERVICES}/mix-backends")
    assert headless["spec"]["clusterIP"] == "None"

    # inferencePool: the router's objects go, the pool and its picker come; the Service is plain again.
    await call(kube, "PATCH", f"{CRS}/mix", {"spec": {"routing": {"mode": "inferencePool"}}}, merge=True)
    await eventually(lambda: only("inferencePool")(kube))
    validate_pool(await asyncio.to_thread(kube.get, f"{POOLS}/mix"))
    service = await eventually(lambda: (s := kube.get(f"{SERVICES}/mix"))["spec"]["selector"]
                               == {"serving.hpi.dev/inference-deployment": "mix"} and s)  # fmt: skip

    # service: today's behaviour, nothing else left behind; the runtime Deployments never moved.
    await call(kube, "PATCH", f"{CRS}/mix", {"spec": {"routing": {"mode": "service"}}}, merge=True)
    await eventually(lambda: only("service")(kube))
    runtime = "serving.hpi.dev/inference-deployment=mix,app.kubernetes.io/component=inference"
    listing = await call(kube, "GET", f"{DEPLOYMENTS}?labelSelector={runtime}")
    assert {d["metadata"]["name"] for d in listing["items"]} == {"mix-gpu-l4", "mix-cpu-amd64-bf16"}


@pytest.mark.slow
async def test_bad_routing_input_degrades_with_an_event(kube: KubeClient, operator: Any) -> None:
    await call(kube, "POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "bad", "namespace": NS}, "spec": {"routing": {"mode": "roundRobin"}}}  # fmt: skip
    # What the CRD's schema catches, the API server refuses (the emulator validates as it does): nothing created.
    with pytest.raises(KubeError) as refused:
        await call(kube, "POST", CRS, body)
    assert refused.value.status == 422 and "spec.routing.mode" in refused.value.body
    # What only the operator can tell (a blank image passes the schema) degrades the resource instead.
    body["spec"]["routing"] = {"mode": "inferencePool", "inferencePool": {"endpointPickerImage": " "}}
    await call(kube, "POST", CRS, body)

    def degraded() -> dict[str, Any]:
        conditions = ((kube.get(f"{CRS}/bad") or {}).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "Degraded" and c["status"] == "True"), {})

    condition = await eventually(degraded)
    assert condition["reason"] == "InvalidSpec" and "endpointPickerImage" in condition["message"]
    events = (await call(kube, "GET", f"/api/v1/namespaces/{NS}/events"))["items"]
    assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" and "endpointPickerImage" in e["message"]
               for e in events if e["involvedObject"]["name"] == "bad")  # fmt: skip
    assert await asyncio.to_thread(kube.get, f"{SERVICES}/bad") is None  # nothing applied from a bad spec
