"""Level-based reconciliation against the emulator: whatever happens to the children, the operator puts them back,
and when nothing happened it writes nothing. The figures in docs/cluster-guide.md ("Reliability") come from here.

The operator runs with a 60 s resync in the self-healing tests, so a child that comes back within seconds was
brought back by its own event, not by the periodic resync.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from hpi_operator import reconcile as reconcile_module
from hpi_operator.handlers import utc_now
from hpi_operator.kube import KubeClient
from hpi_operator.names import FIELD_MANAGER
from hpi_operator.nodes import node_info
from hpi_operator.plan import make_plan
from hpi_operator.reconcile import reconcile
from hpi_operator.status import status_changes
from hpi_testing.cluster_state import (
    object_path,
    operator_write_records,
    operator_writes,
    owned_children,
    reconciles,
    running_operator,
)
from hpi_testing.kube_emulator import L4, eventually, make_node

pytestmark = pytest.mark.slow

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
MERGE = "application/merge-patch+json"
SLOW_RESYNC_S = 60.0
WITHIN_S = 10.0  # far below the resync: only the child's own event can explain a recovery this fast


async def call(kube: KubeClient, method: str, path: str, body: Any = None, content_type: str = "application/json"):
    return await asyncio.to_thread(kube.request, method, path, body, content_type)


def cr(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}  # fmt: skip


async def two_pools(kube: KubeClient) -> None:
    await call(kube, "POST", "/api/v1/nodes", make_node("cpu-0", bf16=True, memory="32Gi"))
    await call(kube, "POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))


def children(kube: KubeClient, uid: str) -> dict[tuple[str, str], dict[str, Any]]:
    return owned_children(kube, NS, uid)


async def test_every_kind_of_child_deleted_is_recreated(kube: KubeClient, api: Any) -> None:
    await two_pools(kube)
    spec = {"replicas": 2, "autoscaling": {"enabled": True, "mode": "hpa", "maxReplicas": 4}}
    with running_operator(api, resync_interval_s=SLOW_RESYNC_S):
        uid = (await call(kube, "POST", CRS, cr("heal", spec)))["metadata"]["uid"]
        # Router mode (two pools): runtime Deployments, PDB, backends Service, the router's Deployment, PDB,
        # ServiceAccount, Role, RoleBinding, the user-facing Service; and the HPA.
        wanted = await eventually(lambda: len(c := children(kube, uid)) == 11 and c)
        recreated = await delete_each(kube, uid, wanted)
        # inferencePool mode and KEDA: the InferencePool, the endpoint picker's objects and the ScaledObject.
        change = {"routing": {"mode": "inferencePool"}, "autoscaling": {"mode": "keda"}}
        await call(kube, "PATCH", f"{CRS}/heal", {"spec": change}, MERGE)
        wanted = await eventually(
            lambda: (
                ("InferencePool", "heal") in (c := children(kube, uid))
                and ("ScaledObject", "heal") in c
                and ("Role", "heal-router") not in c
                and c
            )
        )
        recreated |= await delete_each(kube, uid, {k: v for k, v in wanted.items() if k[0] in
                                                   ("InferencePool", "ScaledObject")})  # fmt: skip
        # The model cache: the claim the operator creates and the Job that fills it.
        model = {"source": "huggingface", "huggingface": {"id": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                 "cache": {"enabled": True}}  # fmt: skip
        await call(kube, "PATCH", f"{CRS}/heal", {"spec": {"model": model}}, MERGE)
        # Both: the claim comes a pass before the Job that fills it.
        cache_kinds = ("PersistentVolumeClaim", "Job")
        wanted = await eventually(lambda: len(c := {k: v for k, v in children(kube, uid).items()
                                                    if k[0] in cache_kinds}) == 2 and c)  # fmt: skip
        recreated |= await delete_each(kube, uid, wanted)
    assert recreated == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "HorizontalPodAutoscaler",
        "InferencePool",
        "ScaledObject",
        "PersistentVolumeClaim",
        "Job",
    }


async def delete_each(kube: KubeClient, uid: str, wanted: dict[tuple[str, str], dict[str, Any]]) -> set[str]:
    """Delete each child in turn; each must come back (a new object: another uid) within WITHIN_S."""
    for (kind, name), obj in wanted.items():
        await call(kube, "DELETE", object_path(kind, NS, name))

        def back(kind: str = kind, name: str = name, old_uid: str = obj["metadata"]["uid"]) -> bool:
            again = kube.get(object_path(kind, NS, name))
            return bool(again) and again["metadata"]["uid"] != old_uid

        await eventually(back, timeout_s=WITHIN_S)
    return {kind for kind, _ in wanted}


async def test_hand_edits_are_reverted_and_foreign_fields_left_alone(kube: KubeClient, api: Any) -> None:
    await two_pools(kube)
    spec = {"replicas": 2, "autoscaling": {"enabled": True, "mode": "hpa", "maxReplicas": 4}}
    with running_operator(api, resync_interval_s=SLOW_RESYNC_S):
        uid = (await call(kube, "POST", CRS, cr("edit", spec)))["metadata"]["uid"]
        await eventually(lambda: len(children(kube, uid)) == 11)
        deployment = object_path("Deployment", NS, "edit-gpu-l4")
        original = await asyncio.to_thread(kube.get, deployment)
        container = original["spec"]["template"]["spec"]["containers"][0]
        edits = {
            "image": {"spec": {"template": {"spec": {"containers": [{**container, "image": "evil:latest"}]}}}},
            "args": {"spec": {"template": {"spec": {"containers": [{**container, "args": ["serve", "--debug"]}]}}}},
            "replicas": {"spec": {"replicas": 7}},
            "operator's label": {"metadata": {"labels": {"app.kubernetes.io/component": "hacked"}}},
        }
        for what, edit in edits.items():
            # Every edit also adds a label and an annotation of its own: the operator does not own those.
            foreign = {"metadata": {"labels": {f"team-{len(what)}": "x"}, "annotations": {"note": what}}}
            await call(kube, "PATCH", deployment, merge(edit, foreign), MERGE)
            healed = await eventually(lambda: same_declared(kube.get(deployment), original) and kube.get(deployment),
                                      timeout_s=WITHIN_S)  # fmt: skip
            assert healed["metadata"]["labels"][f"team-{len(what)}"] == "x", f"{what}: a foreign label was removed"
            assert healed["metadata"]["annotations"]["note"] == what
        deployment_fields = {e["manager"]: e for e in healed["metadata"]["managedFields"]}
        assert "f:replicas" in deployment_fields[FIELD_MANAGER]["fieldsV1"]["f:spec"]  # the operator's field

        service = object_path("Service", NS, "edit")
        selector = (await asyncio.to_thread(kube.get, service))["spec"]["selector"]
        await call(kube, "PATCH", service, {"spec": {"selector": {"serving.hpi.dev/router": "elsewhere"}}}, MERGE)
        await eventually(lambda: kube.get(service)["spec"]["selector"] == selector, timeout_s=WITHIN_S)
        hpa = object_path("HorizontalPodAutoscaler", NS, "edit")
        await call(kube, "PATCH", hpa, {"spec": {"maxReplicas": 40}}, MERGE)
        await eventually(lambda: kube.get(hpa)["spec"]["maxReplicas"] == 4, timeout_s=WITHIN_S)


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        out[key] = merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def same_declared(live: dict[str, Any], original: dict[str, Any]) -> bool:
    return live["spec"] == original["spec"] and all(
        live["metadata"]["labels"].get(k) == v for k, v in original["metadata"]["labels"].items()
    )


async def test_a_hundred_no_op_resyncs_write_nothing(kube: KubeClient, api: Any, emulator: Any) -> None:
    await two_pools(kube)
    with running_operator(api, resync_interval_s=0.05, debounce_s=0.0) as memo:
        uid = (await call(kube, "POST", CRS, cr("quiet", {"replicas": 2})))["metadata"]["uid"]
        await eventually(lambda: len(children(kube, uid)) == 10)
        await eventually(lambda: (kube.get(f"{CRS}/quiet").get("status") or {}).get("observedGeneration") == 1)
        await eventually(lambda: reconciles(memo, "unchanged") >= 2)  # converged: passes find nothing to do
        since, start = len(list(emulator)), reconciles(memo, "unchanged")
        # The loop itself, resyncing on its own: passes go by, nothing is written.
        await eventually(lambda: reconciles(memo, "unchanged") >= start + 10, timeout_s=120)
        assert operator_writes(emulator, since) == []
    # And the pass the loop runs, a hundred times in a row on the converged state (as fast as the emulator
    # answers, with no kopf in between): not one write request, no status change, no Event.
    body = await asyncio.to_thread(kube.get, f"{CRS}/quiet")
    nodes = [node_info(n) for n in (await call(kube, "GET", "/api/v1/nodes"))["items"]]
    operator_client = KubeClient(api)  # the operator's user agent: its requests count as the operator's

    def resync_100_times() -> list[Any]:
        return [reconcile(body, nodes, operator_client, utc_now()) for _ in range(100)]

    since = len(list(emulator))
    outcomes = await asyncio.to_thread(resync_100_times)
    assert {o.result for o in outcomes} == {"unchanged"}
    assert all(status_changes(body["status"], o.status) == {} and not o.events for o in outcomes)
    assert operator_writes(emulator, since) == []


def fallback_plan(body: Any, nodes: Any, **kwargs: Any) -> Any:
    """A deliberately wrong operator: an unservable model is replaced by another one, and every runtime pod rolls."""
    model = {"source": "huggingface", "huggingface": {"id": "HuggingFaceTB/SmolLM2-135M-Instruct"}}
    return make_plan({**body, "spec": {**body["spec"], "model": model}}, nodes, **kwargs)


def break_operator(monkeypatch: pytest.MonkeyPatch, broken: str | None) -> None:
    """Deliberately wrong operators, for the checks below to catch."""
    if broken == "event-every-pass":  # forgets it has reported the cause
        monkeypatch.setattr(reconcile_module, "_reported", lambda old_status, message: False)
    elif broken == "fallback-model":
        monkeypatch.setattr(reconcile_module, "make_plan", fallback_plan)


@pytest.mark.parametrize("broken", [None, "event-every-pass", "fallback-model"])
async def test_invalid_spec_reports_and_touches_no_child(
    kube: KubeClient, api: Any, emulator: Any, monkeypatch: pytest.MonkeyPatch, broken: str | None
) -> None:
    await two_pools(kube)
    with running_operator(api, resync_interval_s=0.2) as memo:
        uid = (await call(kube, "POST", CRS, cr("typo", {"replicas": 2})))["metadata"]["uid"]
        before = await eventually(lambda: len(c := children(kube, uid)) == 10 and c)
        since = len(emulator.writes)
        # Schema-valid, but not servable: source pvc without its claim.
        await call(kube, "PATCH", f"{CRS}/typo", {"spec": {"model": {"source": "pvc"}}}, MERGE)

        def degraded() -> dict[str, Any]:
            conditions = (kube.get(f"{CRS}/typo").get("status") or {}).get("conditions") or []
            return next((c for c in conditions if c["type"] == "Degraded" and c["reason"] == "InvalidSpec"), {})

        assert "claimName" in (await eventually(degraded))["message"]
        break_operator(monkeypatch, broken)
        start = reconciles(memo)
        await eventually(lambda: reconciles(memo) >= start + 3)  # three more passes over the bad spec

        def untouched() -> None:
            events = kube.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
            num_events = sum(e["reason"] == "InvalidSpec" for e in events)
            assert num_events == 1, f"{num_events} InvalidSpec Events"
            after = children(kube, uid)
            versions = {k: v["metadata"]["resourceVersion"] for k, v in after.items()}
            assert versions == {k: v["metadata"]["resourceVersion"] for k, v in before.items()}, "children changed"
            touched = [w for w in operator_write_records(emulator, since)
                       if not w.resource.endswith(("/inferencedeployments", "/events"))]  # fmt: skip
            assert touched == [], "children written"

        if broken:
            match = {"event-every-pass": "InvalidSpec Events", "fallback-model": "children changed"}[broken]
            with pytest.raises(AssertionError, match=match):
                await asyncio.to_thread(untouched)
            return
        await asyncio.to_thread(untouched)


class Killed(Exception):
    """The operator process dying between two API calls."""


@dataclass(frozen=True)
class DyingClient(KubeClient):
    """The operator's client, in a process that dies before its (writes_left + 1)-th write."""

    writes_left: list[int] = field(default_factory=lambda: [0])

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        if method != "GET":
            if self.writes_left[0] == 0:
                raise Killed(f"killed before {method} {path}")
            self.writes_left[0] -= 1
        return super().request(method, path, body, content_type)


@pytest.mark.parametrize("writes_before_kill", [1, 6])
async def test_operator_killed_mid_reconcile_converges_without_duplicates(
    kube: KubeClient, api: Any, writes_before_kill: int
) -> None:
    await two_pools(kube)
    body = await call(kube, "POST", CRS, cr("crash", {"replicas": 2}))
    uid = body["metadata"]["uid"]
    nodes = [node_info(n) for n in (await call(kube, "GET", "/api/v1/nodes"))["items"]]

    async def killed_during_a_pass() -> None:
        current = await asyncio.to_thread(kube.get, f"{CRS}/crash")
        dying = DyingClient(api, writes_left=[writes_before_kill])
        with pytest.raises(Killed):
            await asyncio.to_thread(reconcile, current, nodes, dying, utc_now())

    async def converges_after_restart() -> None:
        current = await asyncio.to_thread(kube.get, f"{CRS}/crash")
        wanted = {(c["kind"], c["metadata"]["name"]) for c in make_plan(current, nodes).children}
        with running_operator(api, resync_interval_s=SLOW_RESYNC_S):
            found = await eventually(lambda: set(c := children(kube, uid)) == wanted and c)
        for (kind, name), obj in found.items():  # one object per child, each owned once, as planned
            assert [ref["uid"] for ref in obj["metadata"]["ownerReferences"]] == [uid], (kind, name)

    await killed_during_a_pass()  # the first pass after the create: some children written, the rest not
    assert 0 < len(await asyncio.to_thread(children, kube, uid)) < 10
    await converges_after_restart()
    # Killed again in the middle of a routing switch: the new mode's objects half there, the old ones not pruned.
    await call(kube, "PATCH", f"{CRS}/crash", {"spec": {"routing": {"mode": "inferencePool"}}}, MERGE)
    await killed_during_a_pass()
    await converges_after_restart()
    assert ("Role", "crash-router") not in await asyncio.to_thread(children, kube, uid)
