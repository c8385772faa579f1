"""spec.networkPolicy: per routing mode, each policy admits exactly its listed callers on exactly their port
(pure manifests, validated with kubernetes-validate --strict against the newest schemas); garbage peers are a
SpecError; under the real kopf operator against the API emulator, enabling creates the policies, a mode switch
replaces them and disabling prunes them.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from typing import Any

import kopf
import kubernetes
import kubernetes_validate
import pytest

from hpi_operator.cli import main, self_identity
from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.network_policies import OperatorIdentity, parse_self_labels
from hpi_operator.nodes import node_info
from hpi_operator.op_metrics import OperatorMetrics
from hpi_operator.plan import Plan, make_plan
from hpi_operator.spec import SpecError
from hpi_testing.kube_emulator import eventually, make_node, operator_thread

NODES = [node_info(make_node("c", bf16=True))]
ME = OperatorIdentity("hpi-system", {"app.kubernetes.io/name": "hetero-paged-infer",
                                     "app.kubernetes.io/instance": "hpi"})  # fmt: skip
OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "hpi-system"}},
            "podSelector": {"matchLabels": dict(ME.labels)}}  # fmt: skip
SAME_NAMESPACE = {"podSelector": {}}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
ROUTER_PODS = {"podSelector": {"matchLabels": {"serving.hpi.dev/router": "demo"}}}
PICKER_PODS = {"podSelector": {"matchLabels": {"serving.hpi.dev/endpoint-picker": "demo"}}}
RUNTIME_PODS = {"serving.hpi.dev/inference-deployment": "demo"}


def plan(spec: dict[str, Any], operator: OperatorIdentity | None = ME) -> Plan:
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1"}, "spec": spec}  # fmt: skip
    return make_plan(body, NODES, operator=operator)


def policies(spec: dict[str, Any], mode: str, operator: OperatorIdentity | None = ME) -> dict[str, dict[str, Any]]:
    p = plan({"replicas": 2, "routing": {"mode": mode}, **spec}, operator)
    found = {c["metadata"]["name"]: c for c in p.children if c["kind"] == "NetworkPolicy"}
    assert tuple(found.values()) == p.network_policies
    for policy in found.values():
        kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert policy["metadata"]["labels"]["serving.hpi.dev/inference-deployment"] == "demo"  # the prune finds it
    return found


def admitted(policy: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """port -> every peer admitted to it, over all rules; a rule without `from` or ports would admit everybody
    or every port, which these policies never write."""
    ports: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule["from"] and rule["ports"]
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            ports.setdefault(port["port"], []).extend(rule["from"])
    return ports


def selects(policy: dict[str, Any]) -> dict[str, str]:
    return policy["spec"]["podSelector"]["matchLabels"]


ON = {"networkPolicy": {"enabled": True}}


def test_router_mode_admits_the_router_to_the_runtime_and_the_clients_to_the_router() -> None:
    found = policies(ON, "router")
    assert set(found) == {"demo-runtime", "demo-router"}
    runtime, router = found["demo-runtime"], found["demo-router"]
    assert selects(runtime) == RUNTIME_PODS
    assert admitted(runtime) == {8000: [ROUTER_PODS, OPERATOR, MONITORING]}
    p = plan({"replicas": 2, "routing": {"mode": "router"}, **ON})
    router_pods = next(c for c in p.children if c["metadata"]["name"] == "demo-router" and c["kind"] == "Deployment")
    assert selects(router).items() <= router_pods["spec"]["template"]["metadata"]["labels"].items()
    assert p.service["spec"]["selector"] == selects(router)  # the policy guards what the Service reaches
    assert admitted(router) == {8080: [SAME_NAMESPACE, OPERATOR, MONITORING]}


def test_service_mode_admits_the_clients_to_the_runtime() -> None:
    found = policies(ON, "service")
    assert set(found) == {"demo-runtime"}
    assert admitted(found["demo-runtime"]) == {8000: [SAME_NAMESPACE, OPERATOR, MONITORING]}


def test_inference_pool_mode_admits_the_gateway_and_the_picker() -> None:
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}},
               "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference"}}}  # fmt: skip
    team = {"namespaceSelector": {"matchLabels": {"team": "a"}}}
    found = policies({"networkPolicy": {"enabled": True, "gateway": [gateway], "clients": [team]}}, "inferencePool")
    assert set(found) == {"demo-runtime", "demo-endpoint-picker"}
    # The gateway forwards requests to the runtime pods, the picker scrapes their vllm: gauges, and the clients
    # still call the Service `demo`, which selects the runtime pods in this mode.
    assert admitted(found["demo-runtime"]) == {8000: [gateway, PICKER_PODS, team, OPERATOR, MONITORING]}
    p = plan({"replicas": 2, "routing": {"mode": "inferencePool"}, **ON})
    assert p.service["spec"]["selector"] == selects(found["demo-runtime"])
    picker = found["demo-endpoint-picker"]
    epp = next(c for c in p.children if c["metadata"]["name"] == "demo-epp" and c["kind"] == "Deployment")
    assert selects(picker).items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in epp["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert admitted(picker) == {ports["grpc"]: [gateway], ports["metrics"]: [MONITORING]}


def test_configured_peers_replace_the_defaults() -> None:
    team = {"namespaceSelector": {"matchLabels": {"team": "a"}},
            "podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["chat"]}]}}  # fmt: skip
    scraper = {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}
    found = policies({"networkPolicy": {"enabled": True, "clients": [team], "prometheus": [scraper]}}, "router")
    assert admitted(found["demo-router"]) == {8080: [team, OPERATOR, scraper]}
    assert admitted(found["demo-runtime"]) == {8000: [ROUTER_PODS, OPERATOR, scraper]}


def test_an_empty_peer_list_admits_nobody_rather_than_everybody() -> None:
    # `from: []` would admit every source: the rule is left out, and an empty ingress denies all.
    none = {"enabled": True, "gateway": [], "prometheus": [], "clients": []}
    found = policies({"networkPolicy": none}, "inferencePool", None)
    assert found["demo-endpoint-picker"]["spec"]["ingress"] == []
    assert admitted(found["demo-runtime"]) == {8000: [PICKER_PODS]}
    # The defaults of clients and gateway are the same peer (this namespace): written once.
    assert admitted(policies(ON, "inferencePool")["demo-runtime"]) == {8000: [SAME_NAMESPACE, PICKER_PODS, OPERATOR,
                                                                              MONITORING]}


def test_without_its_own_identity_the_operator_is_not_admitted() -> None:
    found = policies(ON, "router", operator=None)
    assert admitted(found["demo-router"]) == {8080: [SAME_NAMESPACE, MONITORING]}
    assert admitted(found["demo-runtime"]) == {8000: [ROUTER_PODS, MONITORING]}


def test_off_by_default() -> None:
    for mode in ("router", "inferencePool", "service"):
        assert policies({}, mode) == {}


@pytest.mark.parametrize(
    ("network_policy", "message"),
    [
        ({"clients": "everyone"}, r"spec.networkPolicy.clients must be a list of NetworkPolicyPeers"),
        ({"clients": [{}]}, r"spec.networkPolicy.clients\[0\] must be a NetworkPolicyPeer"),
        ({"prometheus": ["monitoring"]}, r"spec.networkPolicy.prometheus\[0\] must be a NetworkPolicyPeer"),
        ({"clients": [{"podSelectr": {}}]}, r"clients\[0\] has unknown fields \['podSelectr'\]"),
        ({"gateway": [{"podSelector": "app=gw"}]}, r"gateway\[0\].podSelector must be a label selector"),
        ({"clients": [{"namespaceSelector": {"matchLabels": {"team": 1}}}]}, r"matchLabels must map label keys"),
        ({"clients": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}]},
         r"matchExpressions\[0\] needs a key and an operator"),
        ({"clients": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]},
         r"In and NotIn need values"),
        ({"clients": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}, r"ipBlock cannot be combined"),
        ({"clients": [{"ipBlock": {"except": ["10.0.0.0/8"]}}]}, r"ipBlock needs a cidr"),
        ({"enabled": "yes"}, r"spec.networkPolicy.enabled must be true or false"),
    ],
)  # fmt: skip
def test_garbage_peers_are_a_spec_error(network_policy, message) -> None:
    with pytest.raises(SpecError, match=message):
        plan({"networkPolicy": {"enabled": True, **network_policy}})


def test_self_labels_and_namespace_make_the_identity() -> None:
    assert parse_self_labels("a=b, c=d") == {"a": "b", "c": "d"}
    with pytest.raises(ValueError, match="key=value"):
        parse_self_labels("a=b,c")
    args = argparse.Namespace(self_labels="app.kubernetes.io/name=hetero-paged-infer,app.kubernetes.io/instance=hpi",
                              self_namespace="hpi-system")  # fmt: skip
    assert self_identity(args) == ME
    assert self_identity(argparse.Namespace(self_labels="a=b", self_namespace="")) is None  # outside a cluster
    assert self_identity(argparse.Namespace(self_labels="", self_namespace="hpi-system")) is None
    with pytest.raises(SystemExit):
        main(["run", "--self-labels", "no-equals-sign"])


# -- under the operator ---------------------------------------------------------------------------------------

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
POLICIES = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"


@pytest.fixture()
def known_operator(api: kubernetes.client.ApiClient) -> Iterator[Any]:
    """The operator as the chart runs it: it knows its own pod."""
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    with operator_thread(build_registry(OperatorConfig(resync_interval_s=0.5, identity=ME)), memo=memo):
        yield memo


def names(kube: KubeClient) -> set[str]:
    return {item["metadata"]["name"] for item in kube.request("GET", POLICIES).get("items") or []}


@pytest.mark.slow
async def test_enabling_creates_switching_replaces_disabling_prunes(kube: KubeClient, known_operator: Any) -> None:
    async def patch(spec: dict[str, Any]) -> None:
        await asyncio.to_thread(kube.request, "PATCH", f"{CRS}/np", {"spec": spec}, "application/merge-patch+json")

    await asyncio.to_thread(kube.request, "POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "np", "namespace": NS}, "spec": {"replicas": 2}}  # fmt: skip
    created = await asyncio.to_thread(kube.request, "POST", CRS, body)
    await eventually(lambda: kube.get(f"/apis/apps/v1/namespaces/{NS}/deployments/np-router"))
    assert await asyncio.to_thread(names, kube) == set()  # off by default

    await patch({"networkPolicy": {"enabled": True}})
    await eventually(lambda: names(kube) == {"np-runtime", "np-router"})
    runtime = await asyncio.to_thread(kube.get, f"{POLICIES}/np-runtime")
    assert runtime["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    assert OPERATOR in runtime["spec"]["ingress"][0]["from"]  # the identity reached the plan
    assert MONITORING in runtime["spec"]["ingress"][0]["from"]  # the CRD's default, filled by the API server

    await patch({"routing": {"mode": "inferencePool"}})
    await eventually(lambda: names(kube) == {"np-runtime", "np-endpoint-picker"})
    runtime = await asyncio.to_thread(kube.get, f"{POLICIES}/np-runtime")
    picker = {"podSelector": {"matchLabels": {"serving.hpi.dev/endpoint-picker": "np"}}}
    assert picker in runtime["spec"]["ingress"][0]["from"]

    await patch({"networkPolicy": {"enabled": False}})
    await eventually(lambda: names(kube) == set())
    assert await asyncio.to_thread(kube.get, f"{CRS}/np")  # the resource itself stays
