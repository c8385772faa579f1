"""The emulator answers server-side apply and custom-resource writes as a kube-apiserver does, so operator tests
fail where a real cluster would: managed fields, conflicts, no-op writes, pruning, defaulting, validation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from hpi_operator.kube import KubeClient, KubeError
from hpi_operator.names import FIELD_MANAGER

NS = "default"
CMS = f"/api/v1/namespaces/{NS}/services"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


async def call(kube: KubeClient, method: str, path: str, body: Any = None, content_type: str = "application/json"):
    return await asyncio.to_thread(kube.request, method, path, body, content_type)


def service(selector: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "s", "namespace": NS, "labels": labels or {"app": "x"}},
            "spec": {"selector": selector, "ports": [{"port": 80}]}}  # fmt: skip


def managers(obj: dict[str, Any]) -> dict[str, str]:
    return {e["manager"]: e["operation"] for e in obj["metadata"].get("managedFields") or []}


async def test_apply_creates_then_a_same_apply_writes_nothing(kube: KubeClient, emulator: Any) -> None:
    path = f"{CMS}/s?fieldManager={FIELD_MANAGER}&force=true"
    created = await call(kube, "PATCH", path, service({"app": "x"}), APPLY)
    assert created["metadata"]["uid"] and managers(created) == {FIELD_MANAGER: "Apply"}
    fields = created["metadata"]["managedFields"][0]["fieldsV1"]
    assert fields["f:spec"]["f:selector"] == {"f:app": {}}
    again = await call(kube, "PATCH", path, service({"app": "x"}), APPLY)
    assert again["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]  # not stored again
    with pytest.raises(KubeError) as missing_manager:
        await call(kube, "PATCH", f"{CMS}/s", service({"app": "x"}), APPLY)
    assert missing_manager.value.status == 400


async def test_apply_conflicts_with_another_managers_field_unless_forced(kube: KubeClient, emulator: Any) -> None:
    await call(kube, "PATCH", f"{CMS}/s?fieldManager={FIELD_MANAGER}", service({"app": "x"}), APPLY)
    # Someone edits a field the operator applied (kubectl edit: an update, manager from the user agent).
    edited = await call(kube, "PATCH", f"{CMS}/s", {"spec": {"selector": {"app": "hacked"}}}, MERGE)
    assert managers(edited) == {FIELD_MANAGER: "Apply", "hpi-tests": "Update"}
    with pytest.raises(KubeError) as conflict:
        await call(kube, "PATCH", f"{CMS}/s?fieldManager={FIELD_MANAGER}", service({"app": "x"}), APPLY)
    assert conflict.value.status == 409
    assert 'conflict with "hpi-tests": .spec.selector.app' in json.loads(conflict.value.body)["message"]
    forced = await call(kube, "PATCH", f"{CMS}/s?fieldManager={FIELD_MANAGER}&force=true", service({"app": "x"}),
                        APPLY)  # fmt: skip
    assert forced["spec"]["selector"] == {"app": "x"}
    assert managers(forced) == {FIELD_MANAGER: "Apply"}  # the field changed hands


async def test_apply_removes_what_its_manager_stopped_declaring_and_keeps_others_fields(
    kube: KubeClient, emulator: Any
) -> None:
    path = f"{CMS}/s?fieldManager={FIELD_MANAGER}&force=true"
    await call(kube, "PATCH", path, service({"app": "x", "pool": "gpu"}, {"app": "x", "old": "1"}), APPLY)
    await call(kube, "PATCH", f"{CMS}/s", {"metadata": {"labels": {"team": "search"}}}, MERGE)
    result = await call(kube, "PATCH", path, service({"app": "x"}), APPLY)
    assert result["spec"]["selector"] == {"app": "x"}  # dropped from the declaration: removed
    assert result["metadata"]["labels"] == {"app": "x", "team": "search"}  # someone else's label stays


async def test_custom_resources_are_defaulted_pruned_and_validated(kube: KubeClient, emulator: Any) -> None:
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "d", "namespace": NS}, "spec": {"replicas": 2, "typo": True}}  # fmt: skip
    created = await call(kube, "POST", CRS, body)
    assert "typo" not in created["spec"]  # pruned, as the API server does
    assert created["spec"]["routing"]["router"]["replicas"] == 2  # defaults from the schema, nested ones too
    assert created["spec"]["model"]["source"] == "embedded"
    assert ("hpi-tests", "serving.hpi.dev/v1alpha1/inferencedeployments", "d", ".spec.typo") in emulator.pruned
    with pytest.raises(KubeError) as invalid:
        await call(kube, "PATCH", f"{CRS}/d", {"spec": {"replicas": -1}}, MERGE)
    assert invalid.value.status == 422 and "spec.replicas" in invalid.value.body


async def test_a_status_field_outside_the_schema_is_dropped_and_recorded(kube: KubeClient, emulator: Any) -> None:
    """What makes an undeclared status field a test failure: the emulator drops it as a cluster would and records
    it; the `emulator` fixture fails any test in which the operator's own writes had a field dropped."""
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "d", "namespace": NS}, "spec": {}}  # fmt: skip
    await call(kube, "POST", CRS, body)
    written = await call(kube, "PATCH", f"{CRS}/d/status", {"status": {"replicas": 1, "madeUp": {"x": 1}}}, MERGE)
    assert written["status"] == {"replicas": 1}
    assert ("hpi-tests", "serving.hpi.dev/v1alpha1/inferencedeployments", "d", ".status.madeUp") in emulator.pruned
    emulator.pruned.clear()  # this test's own write, not the operator's


async def test_every_write_request_is_logged_and_says_whether_it_stored(kube: KubeClient, emulator: Any) -> None:
    path = f"{CMS}/s?fieldManager={FIELD_MANAGER}&force=true"
    await call(kube, "PATCH", path, service({"app": "x"}), APPLY)
    await call(kube, "PATCH", path, service({"app": "x"}), APPLY)  # the same apply again: nothing to store
    await call(kube, "DELETE", f"{CMS}/s")
    assert [(w.verb, w.resource, w.name, w.manager, w.stored) for w in emulator.writes] == [
        ("apply", "v1/services", "s", FIELD_MANAGER, True),
        ("apply", "v1/services", "s", FIELD_MANAGER, False),
        ("delete", "v1/services", "s", "hpi-tests", True),
    ]
