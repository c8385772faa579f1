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

    def allows(self, api_group: str, resource: str, verb: str) -> bool:
        return (self.api_group, self.resource) == (api_group, resource) and verb in self.verbs


RULES: tuple[Rule, ...] = (
    # kopf: watch InferenceDeployments, keep its annotations and finalizer on them, write status.
    Rule(GROUP, PLURAL, ("list", "watch", "patch"), "watch the resource; kopf annotations and finalizer"),
    Rule(GROUP, f"{PLURAL}/status", ("patch",), "conditions, replicas, pools"),
    # The node inventory (a kopf index fed by a watch).
    Rule("", "nodes", ("list", "watch"), "node pools from GFD/NFD labels"),
    # The builtin autoscaler's index of ready runtime pods to scrape (autoscale_handlers.py).
    Rule("", "pods", ("list", "watch"), "scrape targets of the builtin KV-cache autoscaler"),
    # Children (kube.py): read, create, patch when the spec-hash differs, prune dropped pools.
    Rule("apps", "deployments", ("get", "list", "watch", "create", "patch", "delete"), "one per node pool"),
    Rule("", "services", ("get", "create", "patch"), "one per InferenceDeployment"),
    Rule("policy", "poddisruptionbudgets", ("get", "create", "patch"), "one per InferenceDeployment"),
    # spec.model.cache (cache_sync.py): the claim it creates, the Jobs that fill it and remove old revisions.
    Rule("", "persistentvolumeclaims", ("get", "create", "patch"), "the model cache claim, unless one is named"),
    Rule("batch", "jobs", ("get", "list", "create", "delete"), "model cache downloads and old-revision removal"),
    # spec.autoscaling.mode hpa|keda: one HPA or ScaledObject; the other kind is pruned on a mode change.
    Rule("autoscaling", "horizontalpodautoscalers", ("get", "list", "create", "patch", "delete"), "mode hpa"),
    Rule("keda.sh", "scaledobjects", ("get", "list", "create", "patch", "delete"), "mode keda"),
    # Events: ours (kopf.event) and kopf's own.
    Rule("", "events", ("create",), "Events on InferenceDeployments"),
    # kopf resolves its resources at start-up and watches for new ones; it lists and watches namespaces whenever
    # it serves named namespaces rather than the whole cluster (kopf/_core/reactor/observation.py).
    Rule("", "namespaces", ("list", "watch"), "kopf's namespace observer", only_when="run --namespace"),
    Rule("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"), "kopf's resource observer"),
)


def allowed(api_group: str, resource: str, verb: str) -> bool:
    return any(rule.allows(api_group, resource, verb) for rule in RULES)
