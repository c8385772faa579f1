"""Pure builders of spec.networkPolicy: NetworkPolicies that let each pod of an InferenceDeployment be called
only by its in-cluster callers, listed here one by one (docs/cluster-guide.md, "Network policies", has the table).

| pods (policy)                     | port        | callers                                                        |
|-----------------------------------|-------------|----------------------------------------------------------------|
| runtime (`<name>-runtime`)        | 8000        | the front: router pods (mode router), the gateway peers and the |
|                                   |             | endpoint picker, which scrapes them, and the clients peers,    |
|                                   |             | whose Service `<name>` still selects the runtime pods (mode    |
|                                   |             | inferencePool), or the clients peers (mode service); the       |
|                                   |             | operator; prometheus                                           |
| router (`<name>-router`)          | 8080        | the clients peers; the operator (it scrapes the router's queue);|
|                                   |             | prometheus                                                     |
| endpoint picker                   | 9002 (gRPC) | the gateway peers                                              |
| (`<name>-endpoint-picker`)        | 9090        | prometheus                                                     |

Only ingress is restricted (policyTypes [Ingress]): egress stays open, so pods still reach DNS, the model hub
and each other's Services. Kubelet probes come from the node itself, which common CNIs (Calico, Cilium, Antrea)
always admit, so no rule is needed for them; the endpoint picker's gRPC health port is left to its probes alone.

The runtime serves the OpenAI API and /metrics on one port. A NetworkPolicy matches addresses and ports, never
HTTP paths, so whatever may scrape the runtime may also reach its API: the prometheus peers get the API port
too. spec.apiKeySecretRef still guards /v1 there; separating the ports would take a runtime change.

Pools whose replicas span nodes (LeaderWorkerSet groups, manifests_lws.py) add one policy, `<name>-group`: the pods
of the groups (leaders and workers, label serving.hpi.dev/group-member) admit each other on every port, since
torch.distributed (gloo, NCCL) listens on ports it picks at start. Workers are selected by no other policy: only
their group reaches them.

An empty peer list admits nobody on that rule: a rule whose `from` is empty would admit everybody, so such a
rule is left out rather than written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .manifests import Owner, common_labels, selector_labels, short_name
from .manifests_lws import group_labels
from .names import LABEL_COMPONENT, RUNTIME_PORT
from .routing_manifests import (
    EPP_GRPC_PORT,
    EPP_METRICS_PORT,
    LABEL_ENDPOINT_PICKER,
    LABEL_ROUTER,
    ROUTER_PORT,
)
from .spec import InferenceSpec

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server (1.21+)


@dataclass(frozen=True)
class OperatorIdentity:
    """Where the operator's own pod runs and the labels that select it: it calls the runtime and router pods
    (metrics scrapes, sleep/wake), so the policies must admit it. Known only inside a cluster, from the chart
    (POD_NAMESPACE, --self-labels); None elsewhere, and the policies then admit no operator."""

    namespace: str
    labels: Mapping[str, str]

    def peer(self) -> dict[str, Any]:
        return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: self.namespace}},
                "podSelector": {"matchLabels": dict(self.labels)}}  # fmt: skip


def parse_self_labels(text: str) -> dict[str, str]:
    """`k=v,k2=v2` (the form of `--self-labels`) -> a dict; ValueError for anything else."""
    labels = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = term.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"not a label term key=value: {term!r}")
        labels[key.strip()] = value.strip()
    return labels


def runtime_policy_name(owner_name: str) -> str:
    return short_name(f"{owner_name}-runtime")


def router_policy_name(owner_name: str) -> str:
    return short_name(f"{owner_name}-router")


def endpoint_picker_policy_name(owner_name: str) -> str:
    return short_name(f"{owner_name}-endpoint-picker")


def group_policy_name(owner_name: str) -> str:
    return short_name(f"{owner_name}-group")


def _rule(port: int, peers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One ingress rule, or none when no peer is allowed (`from: []` would admit everybody). A peer listed twice
    (the clients' and the gateway's default are both "this namespace") is written once."""
    unique = list({json.dumps(p, sort_keys=True): dict(p) for p in peers}.values())
    if not unique:
        return []
    return [{"from": unique, "ports": [{"port": port, "protocol": "TCP"}]}]


def _policy(owner: Owner, name: str, pod_selector: Mapping[str, str], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    labels = {**common_labels(owner.name), LABEL_COMPONENT: "network-policy"}
    # An empty ingress list with policyTypes [Ingress] denies every caller: what "nobody is listed" means.
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": owner.namespace, "labels": labels, "annotations": {}},
            "spec": {"podSelector": {"matchLabels": dict(pod_selector)}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}  # fmt: skip


def network_policies(owner: Owner, spec: InferenceSpec, mode: str, operator: OperatorIdentity | None,
                     multi_node: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """The policies of routing `mode` (the effective one), and with `multi_node` (a pool runs groups) the groups';
    none while spec.networkPolicy is off."""
    np = spec.network_policy
    if not np.enabled:
        return []
    me = [operator.peer()] if operator is not None else []
    router_pods = {"podSelector": {"matchLabels": {LABEL_ROUTER: short_name(owner.name)}}}
    picker_pods = {"podSelector": {"matchLabels": {LABEL_ENDPOINT_PICKER: short_name(owner.name)}}}
    # In mode inferencePool the Service `<name>` still selects the runtime pods for in-cluster clients.
    front = {"router": [router_pods], "inferencePool": [*np.gateway, picker_pods, *np.clients]}.get(
        mode, list(np.clients))
    policies = [_policy(owner, runtime_policy_name(owner.name), selector_labels(owner.name),
                        _rule(RUNTIME_PORT, [*front, *me, *np.prometheus]))]  # fmt: skip
    if mode == "router":
        policies.append(_policy(owner, router_policy_name(owner.name), router_pods["podSelector"]["matchLabels"],
                                _rule(ROUTER_PORT, [*np.clients, *me, *np.prometheus])))  # fmt: skip
    if mode == "inferencePool":
        policies.append(_policy(owner, endpoint_picker_policy_name(owner.name),
                                picker_pods["podSelector"]["matchLabels"],
                                _rule(EPP_GRPC_PORT, np.gateway) + _rule(EPP_METRICS_PORT, np.prometheus)))  # fmt: skip
    if multi_node:
        members = group_labels(owner.name)
        policies.append(_policy(owner, group_policy_name(owner.name), members,
                                [{"from": [{"podSelector": {"matchLabels": dict(members)}}]}]))  # fmt: skip
    return policies
