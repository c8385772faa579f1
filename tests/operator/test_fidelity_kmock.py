"""The operator against the emulator's Kubernetes semantics (quantities stored canonical, lists merged by their
keys, field ownership): what used to pass only because the emulator was kinder than an API server.

Each pass here is the operator's own reconcile called directly (as the kopf handlers and the resync timer call
it), so "one pass" and "a hundred passes" are exact counts, not waits. Each deliberate break of the operator's
drift check is kept as a parametrized case: the same test must then see the bug.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hpi_operator import drift
from hpi_operator.handlers import utc_now
from hpi_operator.kube import KubeClient
from hpi_operator.names import FIELD_MANAGER
from hpi_operator.nodes import node_info
from hpi_operator.reconcile import reconcile
from hpi_testing.cluster_state import field_owners, object_path, operator_write_records, running_operator
from hpi_testing.kube_emulator import L4, eventually, make_node

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
SMP = "application/strategic-merge-patch+json"  # what `kubectl patch` and `kubectl edit` send for built-in kinds
MERGE = "application/merge-patch+json"
EDITOR = "kubectl-edit"  # the field manager of the hand edits


def _old_same_scalar(desired: Any, live: Any) -> bool:
    """drift._same_scalar before the fix: a quantity declared as a number never equals the stored string."""
    if desired == live:
        return True
    if isinstance(desired, str) and isinstance(live, str | int) and not isinstance(live, bool):
        try:
            return drift.parse_quantity(desired) == drift.parse_quantity(live)
        except ValueError:
            return False
    return False


BREAKS = {
    "numbers are not quantities": lambda mp: mp.setattr(drift, "_same_scalar", _old_same_scalar),
    "lists are atomic": lambda mp: mp.setattr(drift, "map_list_keys", lambda path: None),
}


class Cluster:
    """The emulated cluster as the operator sees it: one InferenceDeployment, its nodes, and passes on demand."""

    def __init__(self, kube: KubeClient, api: Any, emulator: Any) -> None:
        self.kube, self.emulator = kube, emulator
        self.operator = KubeClient(api)  # the operator's user agent: its requests count as the operator's

    async def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        return await asyncio.to_thread(self.kube.request, method, path, body, content_type)

    async def edit(self, path: str, body: Any, content_type: str = SMP) -> Any:
        return await self.call("PATCH", f"{path}?fieldManager={EDITOR}", body, content_type)

    async def passes(self, name: str, count: int = 1) -> list[Any]:
        body = await self.call("GET", f"{CRS}/{name}")
        nodes = [node_info(n) for n in (await self.call("GET", "/api/v1/nodes"))["items"]]
        return await asyncio.to_thread(lambda: [reconcile(body, nodes, self.operator, utc_now()) for _ in range(count)])

    def operator_writes(self, since: int) -> list[Any]:
        return operator_write_records(self.emulator, since)


async def cluster_with(kube: KubeClient, api: Any, emulator: Any, name: str, spec: dict[str, Any]) -> Cluster:
    cluster = Cluster(kube, api, emulator)
    await cluster.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}  # fmt: skip
    await cluster.call("POST", CRS, body)
    (first,) = await cluster.passes(name)
    assert first.result == "applied" and first.error is None
    return cluster


QUANTITY_FORMS = {
    "integers": {"requests": {"cpu": 2, "memory": 17179869184}, "limits": {"memory": 17179869184}},
    "canonical strings": {"requests": {"cpu": "2", "memory": "16Gi"}, "limits": {"memory": "16Gi"}},
    "non-canonical strings": {"requests": {"cpu": "2000m", "memory": "16384Mi"}, "limits": {"memory": "0.015625Ti"}},
    "fractions": {"requests": {"cpu": "0.5", "memory": "1.5Gi"}, "limits": {"memory": "1536Mi"}},
}


@pytest.mark.parametrize("form", QUANTITY_FORMS)
@pytest.mark.parametrize("broken", [None, "numbers are not quantities"])
async def test_a_hundred_resyncs_write_nothing_whatever_form_the_quantities_take(
    kube: KubeClient, api: Any, emulator: Any, monkeypatch: pytest.MonkeyPatch, form: str, broken: str | None
) -> None:
    """The API server stores quantities canonical (`2` -> "2", "16384Mi" -> "16Gi", "0.5" -> "500m"); a resync
    that finds the children as the operator declared them writes nothing, however the user wrote them."""
    if broken:
        BREAKS[broken](monkeypatch)
    cluster = await cluster_with(kube, api, emulator, "q", {"replicas": 1, "resources": QUANTITY_FORMS[form]})
    live = await cluster.call("GET", object_path("Deployment", NS, "q-gpu-l4"))
    stored = live["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert all(isinstance(v, str) for part in stored.values() for v in part.values())  # canonical strings
    since = len(emulator.writes)
    outcomes = await cluster.passes("q", 100)
    writes = cluster.operator_writes(since)
    sees_the_bug = broken is not None and form == "integers"
    if sees_the_bug:
        assert len(writes) >= 100 and {o.result for o in outcomes} == {"applied"}  # re-applied on every pass
    else:
        assert writes == [] and {o.result for o in outcomes} == {"unchanged"}


def runtime_container(deployment: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "runtime")


GPU_SPEC = {"replicas": 1}
DEPLOYMENT = object_path("Deployment", NS, "h-gpu-l4")  # the runtime pods of the one (L4) pool


@pytest.mark.parametrize("broken", [None, "lists are atomic"])
async def test_a_hand_added_env_var_and_volume_mount_are_kept_and_are_not_drift(
    kube: KubeClient, api: Any, emulator: Any, monkeypatch: pytest.MonkeyPatch, broken: str | None
) -> None:
    """env and volumeMounts are `x-kubernetes-list-type: map` (keys name, mountPath): a strategic merge patch
    adds an item, and the operator's forced apply keeps it (another manager owns it). By design the operator
    leaves them (docs/cluster-guide.md, "Field ownership"), so they are not drift: no write on later passes."""
    if broken:
        BREAKS[broken](monkeypatch)
    cluster = await cluster_with(kube, api, emulator, "h", GPU_SPEC)
    added = {"spec": {"template": {"spec": {
        "containers": [{"name": "runtime", "env": [{"name": "DEBUG", "value": "1"}],
                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}],
        "volumes": [{"name": "scratch", "emptyDir": {}}],
    }}}}  # fmt: skip
    edited = await cluster.edit(DEPLOYMENT, added)
    container = runtime_container(edited)
    assert {"name": "DEBUG", "value": "1"} in container["env"] and len(container["env"]) > 1  # merged, not replaced
    since = len(emulator.writes)
    outcomes = await cluster.passes("h", 3)
    live = runtime_container(await cluster.call("GET", DEPLOYMENT))
    assert {"name": "DEBUG", "value": "1"} in live["env"]  # a forced apply keeps another manager's item
    assert {"name": "scratch", "mountPath": "/scratch"} in live["volumeMounts"]
    if broken:
        assert len(cluster.operator_writes(since)) == 3  # atomic lists see drift on every pass
    else:
        assert cluster.operator_writes(since) == [] and {o.result for o in outcomes} == {"unchanged"}


async def test_an_edited_image_is_reverted_in_one_pass_and_the_field_changes_hands(
    kube: KubeClient, api: Any, emulator: Any
) -> None:
    cluster = await cluster_with(kube, api, emulator, "h", GPU_SPEC)
    image = runtime_container(await cluster.call("GET", DEPLOYMENT))["image"]
    edit = {"spec": {"template": {"spec": {"containers": [{"name": "runtime", "image": "evil:latest"}]}}}}
    edited = await cluster.edit(DEPLOYMENT, edit)
    assert runtime_container(edited)["image"] == "evil:latest"
    assert len(edited["spec"]["template"]["spec"]["containers"]) == 1  # merged into the item, not appended
    (outcome,) = await cluster.passes("h")
    live = await cluster.call("GET", DEPLOYMENT)
    assert outcome.result == "applied" and runtime_container(live)["image"] == image
    owners = field_owners(live, "spec", "template", "spec", "containers", 'k:{"name":"runtime"}', "image")
    assert owners == {FIELD_MANAGER}


async def test_a_removed_port_comes_back_in_one_pass(kube: KubeClient, api: Any, emulator: Any) -> None:
    """containers[].ports is a map list keyed by containerPort + protocol: `$patch: delete` removes one item."""
    cluster = await cluster_with(kube, api, emulator, "h", GPU_SPEC)
    port = runtime_container(await cluster.call("GET", DEPLOYMENT))["ports"][0]
    delete = {"$patch": "delete", "containerPort": port["containerPort"]}
    edited = await cluster.edit(DEPLOYMENT, {"spec": {"template": {"spec": {
        "containers": [{"name": "runtime", "ports": [delete]}]}}}})  # fmt: skip
    assert not runtime_container(edited).get("ports")
    (outcome,) = await cluster.passes("h")
    assert outcome.result == "applied"
    assert runtime_container(await cluster.call("GET", DEPLOYMENT))["ports"] == [port]


async def test_a_replaced_toleration_list_is_put_back_whole(kube: KubeClient, api: Any, emulator: Any) -> None:
    """tolerations is `x-kubernetes-list-type: atomic`: a patch replaces the whole list and its editor owns it;
    the operator's forced apply takes it back whole in one pass."""
    cluster = await cluster_with(kube, api, emulator, "h", GPU_SPEC)
    declared = (await cluster.call("GET", DEPLOYMENT))["spec"]["template"]["spec"]["tolerations"]
    assert declared  # the GPU pool tolerates the nvidia.com/gpu taint
    mine = [{"key": "team", "operator": "Equal", "value": "search", "effect": "NoSchedule"}]
    edited = await cluster.edit(DEPLOYMENT, {"spec": {"template": {"spec": {"tolerations": mine}}}})
    assert edited["spec"]["template"]["spec"]["tolerations"] == mine  # replaced, not merged
    (outcome,) = await cluster.passes("h")
    assert outcome.result == "applied"
    assert (await cluster.call("GET", DEPLOYMENT))["spec"]["template"]["spec"]["tolerations"] == declared


async def test_the_operator_recovers_from_410_gone_after_the_history_is_compacted(
    kube: KubeClient, api: Any, emulator: Any
) -> None:
    """A watch that resumes from a compacted resourceVersion gets 410 Gone (API conventions, "Efficient
    detection of changes"); the operator must list again and keep reconciling, not stall or crash."""
    cluster = Cluster(kube, api, emulator)
    await cluster.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    with running_operator(api, resync_interval_s=60.0):
        await cluster.call("POST", CRS, {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
                                         "metadata": {"name": "before", "namespace": NS}, "spec": {}})  # fmt: skip
        await eventually(lambda: kube.get(object_path("Deployment", NS, "before-gpu-l4")))
        # Writes no InferenceDeployment watch sees move the revision past the operator's last one; then etcd
        # compacts and every stream ends (as at a watch timeout): each reconnect is from a compacted revision.
        await cluster.call("POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
        emulator.compact()
        await emulator.end_watches()
        await eventually(lambda: emulator.expired_watches > 0)
        await cluster.call("POST", CRS, {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
                                         "metadata": {"name": "after", "namespace": NS}, "spec": {}})  # fmt: skip
        await eventually(lambda: kube.get(object_path("Deployment", NS, "after-gpu-l4")))


async def test_the_operator_writes_status_only_through_the_status_subresource(
    kube: KubeClient, api: Any, emulator: Any
) -> None:
    """With a status subresource, the API server ignores `status` in writes to the main resource (and spec in
    writes to /status): a status sent the wrong way is lost on a real cluster. Every write of the operator (its
    handlers through kopf, the autoscaler) that carries a status goes to /status, and none to /status carries
    anything else but metadata."""
    cluster = Cluster(kube, api, emulator)
    await cluster.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    with running_operator(api, resync_interval_s=0.2):
        await cluster.call("POST", CRS, {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
                                         "metadata": {"name": "s", "namespace": NS},
                                         "spec": {"autoscaling": {"enabled": True, "maxReplicas": 3}}})  # fmt: skip
        await eventually(lambda: (kube.get(f"{CRS}/s").get("status") or {}).get("observedGeneration") == 1)
    own = [w for w in emulator.writes if w.resource.endswith("/inferencedeployments") and w.manager != "hpi-tests"]
    assert any(w.subresource == "status" for w in own)
    for write in own:
        if "status" in write.fields:
            assert write.subresource == "status", write
        if write.subresource == "status":
            assert set(write.fields) <= {"status", "metadata", "apiVersion", "kind"}, write
