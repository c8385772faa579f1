"""The RBAC the operator needs: exactly the API calls it makes (its own and kopf's), nothing more.

The Helm chart's ClusterRole and Role must grant exactly these rules (tests/chart/test_rbac.py compares them
with the chart and with rules derived from the code), and the operator tests check that every request the
running operator sends is covered by them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .names import GROUP, PLURAL


@dataclass(frozen=True)
class Rule:
    api_group: str
    resource: str
    verbs: tuple[str, ...]
    why: str
    only_when: str = ""  # a condition under which alone the rule is used; empty: always
    # Held only to hand it on: the API server lets the operator create a Role granting a verb only when it
    # holds that verb itself (RBAC escalation prevention), so the Roles of the router and the endpoint picker
    # need these verbs on the operator, which never calls them.
    delegated: bool = False

    def allows(self, api_group: str, resource: str, verb: str) -> bool:
        return (self.api_group, self.resource) == (api_group, resource) and verb in self.verbs


# Server-side apply is a PATCH; when it creates the object the API server also authorizes it as `create`.
# Every child kind is watched (list/watch): its events wake the owning InferenceDeployment's reconcile.
_CHILD = ("get", "list", "watch", "create", "patch", "delete")

RULES: tuple[Rule, ...] = (
    # kopf: watch InferenceDeployments, keep its finalizer (the reconcile and autoscaler timers) on them, write
    # status; the builtin autoscaler scales them through the scale subresource.
    Rule(GROUP, PLURAL, ("list", "watch", "patch"), "watch the resource; kopf's finalizer"),
    Rule(GROUP, f"{PLURAL}/status", ("patch",), "conditions, replicas, pools"),
    Rule(GROUP, f"{PLURAL}/scale", ("patch",), "the builtin autoscaler's spec.replicas, as an HPA writes it"),
    # The node inventory (a kopf index fed by a watch).
    Rule("", "nodes", ("list", "watch"), "node pools from GFD/NFD labels"),
    # The builtin autoscaler's index of ready runtime pods to scrape (autoscaling/handlers.py).
    Rule("", "pods", ("list", "watch"), "scrape targets of the builtin KV-cache autoscaler; profiling Jobs' results"),
    # Children (children.py): read, applied when they drift, pruned when the plan drops them, watched.
    Rule("apps", "deployments", _CHILD, "one per node pool; the router's or endpoint picker's"),
    Rule("", "services", _CHILD, "user-facing, headless, endpoint picker"),
    Rule("policy", "poddisruptionbudgets", _CHILD, "runtime pods, router"),
    Rule("", "serviceaccounts", _CHILD, "router, endpoint picker"),
    Rule("rbac.authorization.k8s.io", "roles", _CHILD, "their Roles"),
    Rule("rbac.authorization.k8s.io", "rolebindings", _CHILD, "their bindings"),
    Rule("inference.networking.k8s.io", "inferencepools", _CHILD, "routing mode inferencePool"),
    Rule("leaderworkerset.x-k8s.io", "leaderworkersets", _CHILD, "pools whose replicas span nodes"),
    # spec.networkPolicy: the policies of the routing mode; pruned on a mode switch or when it is turned off.
    Rule("networking.k8s.io", "networkpolicies", _CHILD, "spec.networkPolicy"),
    # spec.autoscaling.mode hpa|keda: one HPA or ScaledObject; the other kind is pruned on a mode change.
    Rule("autoscaling", "horizontalpodautoscalers", _CHILD, "mode hpa"),
    Rule("keda.sh", "scaledobjects", _CHILD, "mode keda"),
    # What the routing Roles grant (routing_manifests.ROUTER_RULES, ENDPOINT_PICKER_RULES).
    Rule("discovery.k8s.io", "endpointslices", ("get", "list", "watch"), "the router's Role", delegated=True),
    Rule("", "pods", ("get",), "the endpoint picker's Role", delegated=True),
    Rule(
        "inference.networking.x-k8s.io",
        "inferenceobjectives",
        ("get", "list", "watch"),
        "the endpoint picker's Role",
        delegated=True,
    ),
    # spec.model.cache (cache_sync.py): the claim it creates (never pruned: it holds the weights), the Jobs that
    # fill it and remove old revisions.
    Rule(
        "",
        "persistentvolumeclaims",
        ("get", "list", "watch", "create", "patch"),
        "the model cache claim, unless one is named",
    ),
    Rule("batch", "jobs", ("get", "list", "watch", "create", "delete"),
         "model cache downloads, old-revision removal, pool profiling (profile_sync.py)"),
    # spec.placement.profiling (profile_sync.py): the cache of measured profiles (read, applied) and each pool's
    # profile ConfigMap (applied, pruned). Pods: the profiling Jobs' pods are listed (the rule above, the
    # autoscaler's) for their termination message.
    Rule("", "configmaps", ("get", "list", "create", "patch", "delete"), "pool profiles: the cache, the pools' own"),
    # Events: ours (kopf.event) and kopf's own.
    Rule("", "events", ("create",), "Events on InferenceDeployments"),
    # kopf resolves its resources at start-up and watches for new ones; it lists and watches namespaces whenever
    # it serves named namespaces rather than the whole cluster (kopf/_core/reactor/observation.py).
    Rule("", "namespaces", ("list", "watch"), "kopf's namespace observer", only_when="run --namespace"),
    Rule("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"), "kopf's resource observer"),
)


def allowed(api_group: str, resource: str, verb: str) -> bool:
    return any(rule.allows(api_group, resource, verb) for rule in RULES)
