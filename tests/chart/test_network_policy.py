"""The operator pod's own NetworkPolicy (networkPolicy.enabled): it selects the operator pod, admits the
configured Prometheus peers to the metrics and liveness ports only, and the operator learns its own pod from the
chart (--self-labels, POD_NAMESPACE) so that the InferenceDeployments' policies can admit it. Rendered with helm and
validated strictly against Kubernetes' schemas (the oldest and newest versions the chart supports)."""

from __future__ import annotations

import argparse
from unittest import mock

import kubernetes_validate
import pytest

from hpi_operator import cli
from hpi_operator.network_policies import OperatorIdentity


def policy_and_pod(render, env, values):
    manifests = render(values)
    policies = env.by_kind(manifests, "NetworkPolicy")
    (deployment,) = env.by_kind(manifests, "Deployment")
    return policies, deployment


def test_off_by_default(render, env):
    assert env.by_kind(render(), "NetworkPolicy") == []


@pytest.mark.parametrize("kube_version", ["1.27.0", "1.37.0"])
def test_admits_the_prometheus_peers_to_the_metrics_and_liveness_ports_only(render, env, kube_version):
    values = env.all_features
    (policy,), deployment = policy_and_pod(render, env, values)
    kubernetes_validate.validate(policy, kube_version, strict=True)
    pod = deployment["spec"]["template"]
    assert policy["metadata"]["namespace"] == env.namespace
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == values["networkPolicy"]["prometheus"]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert sorted(p["port"] for p in rule["ports"]) == sorted([ports["metrics"], ports["healthz"]])
    assert {p["protocol"] for p in rule["ports"]} == {"TCP"}


def test_default_peers_are_the_monitoring_namespace(render, env):
    (policy,), _ = policy_and_pod(render, env, {"networkPolicy": {"enabled": True}})
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert policy["spec"]["ingress"][0]["from"] == [monitoring]


def test_no_peers_admit_nobody(render, env):
    # An empty `from` would admit every source: the chart writes no rule at all instead.
    (policy,), _ = policy_and_pod(render, env, {"networkPolicy": {"enabled": True, "prometheus": []}})
    assert policy["spec"]["ingress"] == []
    kubernetes_validate.validate(policy, env.kube_versions[-1], strict=True)


def test_the_operator_knows_its_own_pod(render, env):
    """--self-labels and POD_NAMESPACE, as the operator's CLI parses them, select the operator pod itself."""
    (deployment,) = env.by_kind(render(), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    captured = {}

    def fake_run(args: argparse.Namespace) -> int:
        captured["args"] = args
        return 0

    env_vars = {e["name"]: e for e in container["env"]}
    assert env_vars["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    with mock.patch.object(cli, "run", fake_run), mock.patch.dict("os.environ", {"POD_NAMESPACE": env.namespace}):
        assert cli.main(container["args"]) == 0
    identity = cli.self_identity(captured["args"])
    assert isinstance(identity, OperatorIdentity) and identity.namespace == env.namespace
    assert identity.labels == deployment["spec"]["selector"]["matchLabels"]
    assert identity.labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
