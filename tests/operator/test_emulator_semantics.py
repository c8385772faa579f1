"""The API emulator against Kubernetes' published behaviour: each test states what a real API server does and
where that is written down, so a reader can check the twin against the original.

Sources: the API conventions (community/contributors/devel/sig-architecture/api-conventions.md), the OpenAPI of
the pinned release (hpi_testing.k8s_openapi.SCHEMA_VERSION, as kubernetes-validate ships it), apimachinery's
quantity.go and strategicpatch, the defaulting code cited in hpi_testing/builtin_kinds.py, and the CRD docs
(validation rules, scale subresource).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from hpi_operator.kube import KubeClient, KubeError
from hpi_testing.k8s_openapi import builtin_schema
from hpi_testing.quantity import canonical

NS = "default"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
PVCS = f"/api/v1/namespaces/{NS}/persistentvolumeclaims"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
SMP = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
APPLY = "application/apply-patch+yaml"


async def call(kube: KubeClient, method: str, path: str, body: Any = None, content_type: str = "application/json"):
    return await asyncio.to_thread(kube.request, method, path, body, content_type)


def deployment(name: str = "web", **container: Any) -> dict[str, Any]:
    labels = {"app": name}
    main = {"name": "main", "image": "img:1", **container}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {"containers": [main]}}}}  # fmt: skip


@pytest.mark.parametrize(
    ("written", "stored"),
    [(2, "2"), ("2", "2"), ("2000m", "2"), ("0.5", "500m"), (0.5, "500m"), ("1024Mi", "1Gi"), ("1.5Gi", "1536Mi"),
     ("1000", "1k"), ("1500", "1500"), ("1e3", "1e3"), ("0.5Ki", "512"), ("17408Mi", "17Gi"), ("0", "0"),
     ("100m", "100m"), ("1n", "1n"), ("0.1n", "1n"), ("12e6", "12e6")],
)  # fmt: skip
def test_quantities_are_stored_in_canonical_form(written: Any, stored: str) -> None:
    """apimachinery/pkg/api/resource/quantity.go: CanonicalizeBytes keeps the suffix's format (binary SI, decimal
    SI, decimal exponent), prints the largest exponent that keeps the mantissa whole, and rounds up to nano."""
    assert canonical(written) == stored


async def test_a_deployment_reads_back_canonical_and_defaulted(kube: KubeClient, emulator: Any) -> None:
    """Quantities canonical (quantity.go); defaults from pkg/apis/apps/v1/defaults.go and core/v1/defaults.go."""
    body = deployment(resources={"requests": {"cpu": 2, "memory": "1024Mi"}, "limits": {"cpu": "0.5"}},
                      ports=[{"containerPort": 8000}])  # fmt: skip
    created = await call(kube, "POST", DEPLOYMENTS, body)
    main = created["spec"]["template"]["spec"]["containers"][0]
    assert main["resources"] == {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"cpu": "500m"}}
    assert main["ports"] == [{"containerPort": 8000, "protocol": "TCP"}]
    assert main["imagePullPolicy"] == "IfNotPresent" and main["terminationMessagePath"] == "/dev/termination-log"
    spec = created["spec"]
    assert (spec["replicas"], spec["revisionHistoryLimit"], spec["progressDeadlineSeconds"]) == (1, 10, 600)
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}}
    assert spec["template"]["spec"]["restartPolicy"] == "Always"


def test_list_semantics_come_from_the_published_openapi() -> None:
    """x-kubernetes-list-type / -list-map-keys / -patch-strategy, as the pinned release publishes them."""
    pod = builtin_schema("v1", "Pod").field("spec")
    container = pod.field("containers").items()
    assert (pod.field("containers").list_type, pod.field("containers").map_keys) == ("map", ("name",))
    assert container.field("ports").map_keys == ("containerPort", "protocol")
    assert container.field("volumeMounts").map_keys == ("mountPath",)
    assert pod.field("tolerations").list_type == "atomic" and container.field("args").list_type == "atomic"
    assert "retainKeys" in pod.field("volumes").patch_strategies
    assert container.field("resources").field("limits").field("cpu").is_quantity


async def test_strategic_merge_patch_merges_lists_by_their_keys(kube: KubeClient, emulator: Any) -> None:
    """strategicpatch: containers merge by name, env by name, ports by containerPort ($patch: delete removes one);
    tolerations (no patch strategy) are replaced whole."""
    body = deployment(env=[{"name": "A", "value": "1"}], ports=[{"containerPort": 80}, {"containerPort": 81}])
    body["spec"]["template"]["spec"]["tolerations"] = [{"key": "a", "operator": "Exists"}]
    await call(kube, "POST", DEPLOYMENTS, body)
    patch = {"spec": {"template": {"spec": {
        "containers": [{"name": "main", "env": [{"name": "B", "value": "2"}],
                        "ports": [{"$patch": "delete", "containerPort": 80}]}],
        "tolerations": [{"key": "b", "operator": "Exists"}]}}}}  # fmt: skip
    patched = await call(kube, "PATCH", f"{DEPLOYMENTS}/web", patch, SMP)
    (main,) = patched["spec"]["template"]["spec"]["containers"]
    assert main["image"] == "img:1"  # the item was merged, not replaced
    assert main["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    assert main["ports"] == [{"containerPort": 81, "protocol": "TCP"}]
    assert patched["spec"]["template"]["spec"]["tolerations"] == [{"key": "b", "operator": "Exists"}]
    # A JSON merge patch (RFC 7386) has no list semantics: the containers list is replaced whole.
    merged = await call(kube, "PATCH", f"{DEPLOYMENTS}/web", {"spec": {"template": {"spec": {
        "containers": [{"name": "other", "image": "img:2"}]}}}}, MERGE)  # fmt: skip
    assert [c["name"] for c in merged["spec"]["template"]["spec"]["containers"]] == ["other"]


async def test_strategic_merge_patch_of_a_custom_resource_is_refused(kube: KubeClient, emulator: Any) -> None:
    """CRDs: "strategic merge patch is not supported for custom resources" (415 Unsupported Media Type)."""
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "d", "namespace": NS}, "spec": {}}  # fmt: skip
    await call(kube, "POST", CRS, body)
    with pytest.raises(KubeError) as refused:
        await call(kube, "PATCH", f"{CRS}/d", {"spec": {"replicas": 2}}, SMP)
    assert refused.value.status == 415


async def test_server_side_apply_owns_list_items_and_keeps_others(kube: KubeClient, emulator: Any) -> None:
    """Server-side apply (structured-merge-diff): an item of a map list is `k:{...}` in managedFields; another
    manager's item survives a forced apply; an item the applier stops declaring is removed."""
    path = f"{DEPLOYMENTS}/web?fieldManager=op&force=true"
    config = deployment(env=[{"name": "A", "value": "1"}, {"name": "GONE", "value": "x"}])
    applied = await call(kube, "PATCH", path, config, APPLY)
    fields = json.dumps(applied["metadata"]["managedFields"][0]["fieldsV1"])
    assert '"k:{\\"name\\":\\"main\\"}"' in fields and '"k:{\\"name\\":\\"A\\"}"' in fields
    await call(kube, "PATCH", f"{DEPLOYMENTS}/web?fieldManager=someone", {"spec": {"template": {"spec": {
        "containers": [{"name": "main", "env": [{"name": "MINE", "value": "2"}]}]}}}}, SMP)  # fmt: skip
    again = await call(kube, "PATCH", path, deployment(env=[{"name": "A", "value": "1"}]), APPLY)
    env = again["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env == [{"name": "A", "value": "1"}, {"name": "MINE", "value": "2"}]


async def test_immutable_fields_are_refused_with_the_api_servers_message(kube: KubeClient, emulator: Any) -> None:
    """apps/v1 validation: a Deployment's selector is immutable; core validation: a claim cannot shrink."""
    await call(kube, "POST", DEPLOYMENTS, deployment())
    change = {"spec": {"selector": {"matchLabels": {"app": "other"}},
                       "template": {"metadata": {"labels": {"app": "other"}}}}}  # fmt: skip
    with pytest.raises(KubeError) as refused:
        await call(kube, "PATCH", f"{DEPLOYMENTS}/web", change, MERGE)
    status = json.loads(refused.value.body)
    assert refused.value.status == 422 and status["reason"] == "Invalid"
    assert status["message"].startswith('Deployment.apps "web" is invalid: spec.selector: Invalid value: ')
    assert status["message"].endswith("field is immutable")
    assert status["details"]["causes"][0]["field"] == "spec.selector"
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "c", "namespace": NS},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}}  # fmt: skip
    await call(kube, "POST", PVCS, claim)
    grown = await call(kube, "PATCH", f"{PVCS}/c", {"spec": {"resources": {"requests": {"storage": "20Gi"}}}}, MERGE)
    assert grown["spec"]["resources"]["requests"]["storage"] == "20Gi"
    with pytest.raises(KubeError) as shrunk:
        await call(kube, "PATCH", f"{PVCS}/c", {"spec": {"resources": {"requests": {"storage": "5Gi"}}}}, MERGE)
    assert shrunk.value.status == 422 and "field can not be less than previous value" in shrunk.value.body


async def test_the_crd_validation_rule_is_enforced(kube: KubeClient, emulator: Any) -> None:
    """CRD x-kubernetes-validations (CEL): minReplicas <= maxReplicas, answered 422 with the rule's message."""
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "d", "namespace": NS},
            "spec": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}}  # fmt: skip
    with pytest.raises(KubeError) as refused:
        await call(kube, "POST", CRS, body)
    assert refused.value.status == 422
    assert json.loads(refused.value.body)["message"] == ('InferenceDeployment.serving.hpi.dev "d" is invalid: '
                                                         'spec.autoscaling: Invalid value: "object": '
                                                         "minReplicas must not exceed maxReplicas")  # fmt: skip
    body["spec"]["autoscaling"]["maxReplicas"] = 3
    await call(kube, "POST", CRS, body)
    with pytest.raises(KubeError):
        await call(kube, "PATCH", f"{CRS}/d", {"spec": {"autoscaling": {"minReplicas": 4}}}, MERGE)


async def test_the_scale_subresource_reads_back_as_a_scale(kube: KubeClient, emulator: Any) -> None:
    """The CRD's subresources.scale (specReplicasPath, statusReplicasPath, labelSelectorPath) and apps/v1
    Deployments both answer GET .../scale with an autoscaling/v1 Scale."""
    body = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "d", "namespace": NS}, "spec": {"replicas": 3}}  # fmt: skip
    await call(kube, "POST", CRS, body)
    await call(kube, "PATCH", f"{CRS}/d/status", {"status": {"replicas": 2, "selector": "a=b"}}, MERGE)
    scale = await call(kube, "GET", f"{CRS}/d/scale")
    assert (scale["kind"], scale["apiVersion"]) == ("Scale", "autoscaling/v1")
    assert scale["spec"] == {"replicas": 3} and scale["status"] == {"replicas": 2, "selector": "a=b"}
    await call(kube, "POST", DEPLOYMENTS, deployment())
    assert (await call(kube, "GET", f"{DEPLOYMENTS}/web/scale"))["status"]["selector"] == "app=web"


async def watch_events(server: str, path: str, count: int, **params: str) -> list[dict[str, Any]]:
    events = []
    query, headers = {"watch": "true", **params}, {"Authorization": "Bearer kmock"}
    async with aiohttp.ClientSession() as session, session.get(
        f"{server}{path}", params=query, headers=headers
    ) as response:
        async for line in response.content:
            if line.strip():
                events.append(json.loads(line))
                if len(events) == count:
                    break
    return events


async def test_watches_answer_410_gone_after_compaction_and_send_bookmarks(
    kube: KubeClient, emulator: Any, api: Any
) -> None:
    """API conventions, "Efficient detection of changes": a watch from a resourceVersion older than the history
    gets an ERROR event with a 410 Status (the client must list again); with allowWatchBookmarks=true the server
    sends BOOKMARK events carrying only the current resourceVersion."""
    server = api.configuration.host
    first = await call(kube, "POST", DEPLOYMENTS, deployment("a"))
    await call(kube, "POST", DEPLOYMENTS, deployment("b"))
    emulator.compact()
    since = first["metadata"]["resourceVersion"]
    (gone,) = await asyncio.wait_for(watch_events(server, DEPLOYMENTS, 1, resourceVersion=since), 30)
    assert gone["type"] == "ERROR" and gone["object"]["code"] == 410 and gone["object"]["reason"] == "Expired"
    latest = (await call(kube, "GET", DEPLOYMENTS))["metadata"]["resourceVersion"]
    watching = asyncio.create_task(watch_events(server, DEPLOYMENTS, 2, resourceVersion=latest,
                                                allowWatchBookmarks="true"))  # fmt: skip
    created = await call(kube, "POST", DEPLOYMENTS, deployment("c"))
    while not watching.done():  # the watch may open after the create: bookmarks until it has both
        await emulator.bookmark()
        await asyncio.wait([watching], timeout=0.05)
    added, bookmark = watching.result()
    assert added["type"] == "ADDED" and added["object"]["metadata"]["name"] == "c"
    assert bookmark["type"] == "BOOKMARK"
    assert int(bookmark["object"]["metadata"]["resourceVersion"]) >= int(created["metadata"]["resourceVersion"])


async def test_built_in_objects_are_validated_and_unknown_fields_dropped(kube: KubeClient, emulator: Any) -> None:
    """The published schema's types, enums and required fields are enforced (422); an undeclared field is
    dropped (the API server's default field validation, "Warn") and logged, so a test fails on it."""
    with pytest.raises(KubeError) as refused:
        await call(kube, "POST", DEPLOYMENTS, {**deployment(), "spec": {**deployment()["spec"], "replicas": "two"}})
    assert refused.value.status == 422 and "spec.replicas" in refused.value.body
    body = deployment(bogus=True)
    created = await call(kube, "POST", DEPLOYMENTS, body)
    assert "bogus" not in created["spec"]["template"]["spec"]["containers"][0]
    assert ("hpi-tests", "apps/v1/Deployment", "web", ".spec.template.spec.containers.0.bogus") in emulator.pruned
    emulator.pruned.clear()  # this test's own write, not the operator's
