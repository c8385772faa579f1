"""Least-privilege RBAC: the chart grants exactly the API calls the operator makes, derived from its code.

The expected rules are not written by hand. They come from four places:
- the kopf handlers in hpi_operator (AST): what each decorator makes kopf do (list/watch, and patch for the
  handlers that store progress, finalizers or status);
- kopf's own machinery, read from kopf itself: Events it posts, the CRD observer, the namespace observer
  (only when the operator watches named namespaces instead of the whole cluster);
- the reconciler run for real on the examples against a recording API client: every HTTP call it makes,
  on a fresh cluster and on one where every child exists with a stale spec;
- typed `kubernetes.client` calls anywhere in the package (AST), mapped to their REST paths by the client.
A static scan of every API path in the package then checks that nothing escaped the derivation, and the
operator's own declaration (hpi_operator.rbac.RULES) must agree with both.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml

Rule = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

CHANGE_HANDLERS = {"create", "update", "resume", "delete", "field", "timer", "daemon"}
WATCH_HANDLERS = {"index", "event"}
_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/{}]+)/(?P<version>[^/{}]+))"
    r"(?:/namespaces/[^/]+)?/(?P<resource>[a-z0-9]+)(?P<item>/[^/?]+)?(?:/(?P<sub>status|scale))?(?P<query>\?.*)?$"
)
_VERB = {"POST": "create", "PATCH": "patch", "PUT": "update"}
MODES = [{}, {"operator": {"watchNamespace": "team-a"}}]
EXAMPLES = {
    "embedded-cpu.yaml": "cpu-nodes.yaml",
    "gpu-autoscaling.yaml": "gpu-nodes.yaml",
    "huggingface-cache.yaml": "gpu-nodes.yaml",
    "mixed-gpu-cpu.yaml": "mixed-nodes.yaml",
    "llama-405b-multi-node.yaml": "gpu-nodes.yaml",  # a LeaderWorkerSet
}


def _modules() -> list[tuple[Any, ast.Module]]:
    import hpi_operator

    found = []
    for info in pkgutil.walk_packages(hpi_operator.__path__, "hpi_operator."):
        if info.name.endswith("__main__"):
            continue  # importing it would run the CLI
        module = importlib.import_module(info.name)
        found.append((module, ast.parse(Path(module.__file__).read_text())))
    return found


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _evaluate(node: ast.AST, module: Any, names: dict[str, Any] | None = None) -> Any:
    """A decorator or call argument evaluated in its module's namespace (constants, names, f-strings), with
    `names` bound on top (a loop variable)."""
    return eval(compile(ast.Expression(node), module.__file__, "eval"), {**vars(module), **(names or {})})


def _loop_bindings(tree: ast.Module, module: Any) -> dict[int, list[dict[str, Any]]]:
    """For each call inside a `for` loop over a module constant (handlers registered per resource in a loop):
    the loop variables of every iteration, by id() of the call node."""
    bindings: dict[int, list[dict[str, Any]]] = {}
    for loop in (n for n in ast.walk(tree) if isinstance(n, ast.For)):
        try:
            values = list(_evaluate(loop.iter, module))
        except NameError:
            continue
        targets = [t.id for t in loop.target.elts] if isinstance(loop.target, ast.Tuple) else [loop.target.id]
        iterations = [dict(zip(targets, v if len(targets) > 1 else (v,), strict=True)) for v in values]
        for node in ast.walk(loop):
            if isinstance(node, ast.Call):
                bindings[id(node)] = iterations
    return bindings


def rule_for(method: str, path: str) -> Rule:
    """The RBAC rule one HTTP call needs."""
    match = _PATH.match(path)
    assert match, f"cannot map API path {path!r} to an RBAC resource"
    group = "" if match["core"] else match["group"]
    resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
    is_item = bool(match["item"]) and not (match["query"] or "").startswith("?watch")
    if method == "GET":
        verb = "watch" if "watch=" in (match["query"] or "") else "get" if is_item else "list"
    elif method == "DELETE":
        verb = "delete" if is_item else "deletecollection"
    else:
        verb = _VERB[method]
    return group, resource, verb


def _crd_has_status(group: str, plural: str, repo: Path) -> bool:
    for path in (repo / "crds").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["group"] == group and crd["spec"]["names"]["plural"] == plural:
            return any("status" in (v.get("subresources") or {}) for v in crd["spec"]["versions"])
    return False


def kopf_handler_rules(modules, repo: Path) -> set[Rule]:
    rules: set[Rule] = set()
    for module, tree in modules:
        writes_status = any(
            isinstance(n, ast.Attribute) and n.attr == "status" and _dotted(n.value) == "patch" for n in ast.walk(tree)
        )
        loops = _loop_bindings(tree, module)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not _dotted(node.func).startswith("kopf."):
                continue
            kind = _dotted(node.func).rsplit(".", 1)[-1]
            if kind in {"event", "info", "warn", "exception"} and _dotted(node.func).count(".") == 1:
                rules.add(_kopf_events_rule())  # kopf.event(...) and friends post an Event
                continue
            if kind not in CHANGE_HANDLERS | WATCH_HANDLERS:
                continue
            for names in loops.get(id(node), [{}]):
                rules |= _handler_rules(module, node, kind, names, writes_status, repo)
    return rules


def _handler_rules(module: Any, node: ast.Call, kind: str, names: dict[str, Any], writes_status: bool,
                   repo: Path) -> set[Rule]:  # fmt: skip
    """What one kopf handler decorator makes kopf do."""
    rules: set[Rule] = set()
    args = [_evaluate(a, module, names) for a in node.args]
    if len(args) == 3:
        group, _, plural = args
    elif len(args) == 2 and "/" in args[0]:
        group, plural = args[0].rsplit("/", 1)[0], args[1]
    else:
        pytest.fail(f"{module.__name__}: cannot tell the resource of kopf.{kind}{tuple(args)}")
    group = "" if group == "v1" else group
    rules |= {(group, plural, "list"), (group, plural, "watch")}
    if kind in CHANGE_HANDLERS:
        # Progress, diff-base and finalizers are patches on the object itself.
        rules.add((group, plural, "patch"))
        if writes_status and _crd_has_status(group, plural, repo):
            rules.add((group, f"{plural}/status", "patch"))
        rules.add(_kopf_events_rule())  # kopf posts Events on handler failures
    return rules


def _kopf_events_rule() -> Rule:
    from kopf._cogs.structs import references

    return references.EVENTS.group or "", references.EVENTS.any_name, "create"


def kopf_machinery_rules(clusterwide: bool) -> set[Rule]:
    """What kopf's observers do besides the handlers (see kopf/_core/reactor/observation.py)."""
    from kopf._cogs.structs import references

    rules = {(references.CRDS.group, references.CRDS.any_name, v) for v in ("list", "watch")}
    if not clusterwide:
        rules |= {(references.NAMESPACES.group or "", references.NAMESPACES.any_name, v) for v in ("list", "watch")}
    return rules


def typed_client_rules(modules) -> set[Rule]:
    """Calls of generated `kubernetes.client` API methods, mapped to the REST path the client uses."""
    # kubernetes.client loads its API classes lazily: vars() of the package holds none of them; __all__ names all.
    api_classes = [getattr(kubernetes.client, n) for n in kubernetes.client.__all__ if n.endswith("Api")]
    assert api_classes, "found no generated API classes in kubernetes.client"
    rules: set[Rule] = set()
    for module, tree in modules:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            owners = [c for c in api_classes if hasattr(c, f"_{name}_serialize")]
            if not owners:
                continue
            source = inspect.getsource(getattr(owners[0], f"_{name}_serialize"))
            (path,) = re.findall(r"resource_path='([^']*)'", source)
            (method,) = re.findall(r"method='([A-Z]+)'", source)
            params = list(inspect.signature(getattr(owners[0], name)).parameters)[1:]
            bound = dict(zip(params, node.args, strict=False)) | {k.arg: k.value for k in node.keywords if k.arg}
            for placeholder in ("group", "version", "plural"):
                if "{" + placeholder + "}" in path:
                    path = path.replace("{" + placeholder + "}", str(_evaluate(bound[placeholder], module)))
            if "watch" in bound:
                path += "?watch=true"
            rules.add(rule_for(method, path))
    return rules


def _example_inputs(repo: Path) -> Iterable[tuple[dict[str, Any], list[Any]]]:
    from hpi_operator.nodes import node_info

    for number, (example, nodes_file) in enumerate(EXAMPLES.items()):
        body = yaml.safe_load((repo / "examples" / example).read_text())
        body["metadata"] |= {"namespace": "team-a", "uid": f"00000000-0000-0000-0000-00000000000{number}"}
        body["metadata"]["generation"] = 1
        nodes = yaml.safe_load((repo / "examples" / "nodes" / nodes_file).read_text())["items"]
        yield body, [node_info(n) for n in nodes]


def _with_autoscaler_modes(inputs: Iterable[tuple[dict[str, Any], list[Any]]]):
    """Each example as written, with spec.autoscaling.mode hpa and keda (an HPA or a ScaledObject child), with
    each spec.routing.mode (the router's or the endpoint picker's objects, an InferencePool), with and without
    spec.networkPolicy (the NetworkPolicies of that mode), and with
    spec.placement.profiling always (profiling Jobs, the profile cache, the pools' profile ConfigMaps)."""
    for body, nodes in inputs:
        yield body, nodes
        for mode in ("hpa", "keda"):
            autoscaling = {**(body["spec"].get("autoscaling") or {}), "enabled": True, "mode": mode}
            yield {**body, "spec": {**body["spec"], "autoscaling": autoscaling}}, nodes
        for mode in ("router", "inferencePool", "service"):
            yield {**body, "spec": {**body["spec"], "routing": {"mode": mode}}}, nodes
            # spec.networkPolicy: the NetworkPolicies of each mode.
            policy = {"enabled": True}
            yield {**body, "spec": {**body["spec"], "routing": {"mode": mode}, "networkPolicy": policy}}, nodes
        # spec.placement.profiling: the profiling Jobs, the profile cache and the pools' profile ConfigMaps.
        placement = {**(body["spec"].get("placement") or {}), "profiling": "always"}
        yield {**body, "spec": {**body["spec"], "placement": placement}}, nodes


def reconciler_rules(repo: Path) -> set[Rule]:
    """Run the real reconcile on every example against a recording client, on an empty and a stale cluster,
    and the builtin autoscaler's write of spec.replicas."""
    from hpi_operator import kube, reconcile
    from hpi_operator.cache import LABEL_CACHE_JOB
    from hpi_operator.manifests import selector_labels

    @dataclass(frozen=True)
    class RecordingClient(kube.KubeClient):
        """Answers like an API server: 404 or a stale copy on reads; a list holds one orphaned Deployment."""

        exists: bool = False
        owner_uid: str = ""
        labels: dict[str, str] = field(default_factory=dict)
        calls: list[tuple[str, str, Any]] = field(default_factory=list)

        def request(self, method, path, body=None, content_type="application/json"):
            self.calls.append((method, path, body))
            if "apply-patch" in content_type:  # server-side apply also creates: authorized as `create` then
                self.calls.append(("POST", path.split("?", 1)[0].rsplit("/", 1)[0], body))
            if method == "GET" and "?" in path:
                owner = [{"uid": self.owner_uid}]
                return {"items": [{"metadata": {"name": "stale", "labels": self.labels, "ownerReferences": owner}}]}
            if method == "GET" and not self.exists:
                raise kube.KubeError(404, "not found")
            if method == "GET":
                return {"metadata": {"name": path.rsplit("/", 1)[-1], "annotations": {}}, "spec": {}, "status": {}}
            return dict(body or {})

    calls: list[tuple[str, str, Any]] = []
    for body, nodes in _with_autoscaler_modes(_example_inputs(repo)):
        for exists in (False, True):
            meta = body["metadata"]
            # The stale listed object is also a model-cache fill Job of a revision no longer wanted.
            labels = {**selector_labels(meta["name"]), LABEL_CACHE_JOB: "fill"}
            client = RecordingClient(api=None, exists=exists, owner_uid=meta["uid"], labels=labels)
            reconcile.reconcile(body, nodes, client, "2026-01-01T00:00:00Z")
            calls += client.calls
    from hpi_operator.autoscaling.handlers import write_replicas

    scaler = RecordingClient(api=None)
    write_replicas(scaler, "team-a", "example", 3)  # the builtin autoscaler's one write of its own
    calls += scaler.calls
    assert calls, "the reconciler made no API call: the derivation scenario is broken"
    return {rule_for(method, path) for method, path, _ in calls} | delegated_rules(calls)


def delegated_rules(calls: Iterable[tuple[str, str, Any]]) -> set[Rule]:
    """What the Roles the operator writes grant: the API server lets it write a Role only when it holds every
    verb that Role grants (RBAC escalation prevention), though it never calls them itself."""
    rules: set[Rule] = set()
    for method, _, body in calls:
        if method in ("POST", "PATCH") and isinstance(body, dict) and body.get("kind") == "Role":
            for rule in body["rules"]:
                rules |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return rules


def static_api_resources(modules) -> set[tuple[str, str]]:
    """(group, resource) of every REST path literal in the package, to catch calls the scenarios missed."""
    found = set()
    for _, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            elif isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "x" for v in node.values)
            else:
                continue
            match = _PATH.match(text)
            if match and "{" not in (match["group"] or ""):
                resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
                found.add(("" if match["core"] else match["group"], resource))
    return found


def test_typed_client_calls_map_to_their_rest_rules():
    source = (
        "import kubernetes\n"
        "def read(api: kubernetes.client.CoreV1Api):\n"
        "    api.read_namespaced_secret('token', 'team-a')\n"
        "    kubernetes.client.AppsV1Api().list_namespaced_deployment('team-a', watch=True)\n"
    )
    rules = typed_client_rules([(None, ast.parse(source))])
    assert rules == {("", "secrets", "get"), ("apps", "deployments", "watch")}


@pytest.fixture(scope="module")
def derived(env) -> dict[bool, set[Rule]]:
    """The rules the operator needs, by `clusterwide`."""
    modules = _modules()
    needed = kopf_handler_rules(modules, env.repo) | typed_client_rules(modules) | reconciler_rules(env.repo)
    resources = {(g, r) for g, r, _ in needed} | {(g, r) for g, r, _ in kopf_machinery_rules(True)}
    missed = static_api_resources(modules) - resources
    assert not missed, (
        f"the operator's code names API resources {sorted(missed)} that no derivation scenario exercised: "
        "extend reconciler_rules() (tests/chart/test_rbac.py) to run that code, then grant what it needs in "
        "charts/hetero-paged-infer/templates/rbac.yaml"
    )
    return {clusterwide: needed | kopf_machinery_rules(clusterwide) for clusterwide in (True, False)}


def granted(manifests: list[dict[str, Any]], kind: str) -> set[Rule]:
    rules: set[Rule] = set()
    for role in (m for m in manifests if m["kind"] == kind):
        for rule in role["rules"]:
            assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
            rules |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return rules


def _show(rules: Iterable[Rule]) -> str:
    return "\n".join(f"  {g or 'core'}/{r}: {v}" for g, r, v in sorted(rules))


def test_cluster_wide_grants_exactly_what_the_operator_uses(render, derived):
    manifests = render()
    assert not [m for m in manifests if m["kind"] in ("Role", "RoleBinding")]
    rules = granted(manifests, "ClusterRole")
    assert rules == derived[True], (
        f"granted but unused:\n{_show(rules - derived[True])}\nused but not granted:\n{_show(derived[True] - rules)}"
    )


def test_single_namespace_confines_namespaced_rules_to_a_role(render, derived):
    manifests = render({"operator": {"watchNamespace": "team-a"}})
    cluster, namespaced = granted(manifests, "ClusterRole"), granted(manifests, "Role")
    assert cluster | namespaced == derived[False]
    cluster_scoped = {"nodes", "namespaces", "customresourcedefinitions"}
    assert {r for _, r, _ in cluster} <= cluster_scoped, "namespaced resources leaked into the ClusterRole"
    assert not {r for _, r, _ in namespaced} & cluster_scoped
    (role,) = [m for m in manifests if m["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "team-a"


@pytest.mark.parametrize("values", MODES, ids=["all-namespaces", "one-namespace"])
def test_no_wildcards_and_nothing_dangerous(render, values):
    manifests = render(values)
    for role in (m for m in manifests if m["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"{role['kind']} grants '*' {key}: {rule}"
    rules = granted(manifests, "ClusterRole") | granted(manifests, "Role")
    verbs = {v for _, _, v in rules}
    resources = {r for _, r, _ in rules}
    assert not verbs & {"escalate", "bind", "impersonate", "deletecollection"}
    # Roles and RoleBindings, yes (the router's and the endpoint picker's, in their namespace); cluster-wide ones
    # never. Escalation prevention bounds those Roles by what the operator holds, which the tests above pin.
    assert not resources & {"secrets", "pods/exec", "serviceaccounts/token", "clusterroles", "clusterrolebindings"}
    assert ("apiextensions.k8s.io", "customresourcedefinitions") not in {
        (g, r) for g, r, v in rules if v not in ("get", "list", "watch")
    }, "the operator must not be able to change CRDs"


@pytest.mark.parametrize("values", MODES, ids=["all-namespaces", "one-namespace"])
def test_bindings_grant_the_roles_to_the_operator_account(render, env, values):
    manifests = render(values)
    (account,) = env.by_kind(manifests, "ServiceAccount")
    for binding_kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        for binding in env.by_kind(manifests, binding_kind):
            (role,) = env.by_kind(manifests, role_kind)
            assert binding["roleRef"] == {
                "apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role["metadata"]["name"]
            }  # fmt: skip
            assert binding["subjects"] == [
                {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": env.namespace}
            ]


def _declared() -> tuple[set[Rule], set[Rule]]:
    """The operator's own declaration (hpi_operator.rbac.RULES): (always needed, needed only in some modes)."""
    from hpi_operator import rbac

    always: set[Rule] = set()
    conditional: set[Rule] = set()
    for rule in rbac.RULES:
        triples = {(rule.api_group, rule.resource, verb) for verb in rule.verbs}
        (conditional if rule.only_when else always).update(triples)
    return always, conditional


def test_operator_declaration_matches_the_chart_and_the_derivation(render, derived):
    """hpi_operator.rbac.RULES, the chart and the derivation from code agree.

    Cluster-wide, the chart grants exactly the unconditional rules. Rules the operator marks `only_when`
    (kopf's namespace observer) are granted only when the operator watches named namespaces: kopf lists and
    watches namespaces whenever it is not cluster-wide (kopf/_core/reactor/observation.py).
    """
    always, conditional = _declared()
    assert granted(render(), "ClusterRole") == always == derived[True]
    manifests = render({"operator": {"watchNamespace": "team-a"}})
    assert granted(manifests, "ClusterRole") | granted(manifests, "Role") == always | conditional == derived[False]


def test_derivation_maps_http_calls_to_rbac_verbs():
    assert rule_for("GET", "/apis/apps/v1/namespaces/a/deployments/x") == ("apps", "deployments", "get")
    listing = "/apis/apps/v1/namespaces/a/deployments?labelSelector=k=v"
    assert rule_for("GET", listing) == ("apps", "deployments", "list")
    assert rule_for("GET", "/api/v1/pods?watch=true") == ("", "pods", "watch")
    assert rule_for("POST", "/api/v1/namespaces/a/services") == ("", "services", "create")
    assert rule_for("PATCH", "/apis/g.io/v1/namespaces/a/things/x/scale") == ("g.io", "things/scale", "patch")
    assert rule_for("DELETE", "/apis/apps/v1/namespaces/a/deployments/x") == ("apps", "deployments", "delete")
