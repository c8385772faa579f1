"""The shared model cache under the real kopf operator and the API emulator over HTTP.

The emulator runs no controllers: the tests play the Job controller (patching a Job's status to Complete or
Failed) and the Deployment controller, and check what the operator does through the API, as on a cluster.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Iterator
from typing import Any

import kopf
import kubernetes
import pytest

from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.op_metrics import OperatorMetrics
from hpi_testing.cluster_state import AsyncApi
from hpi_testing.kube_emulator import L4, eventually, make_node, operator_thread

pytestmark = pytest.mark.slow

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
PVCS = f"/api/v1/namespaces/{NS}/persistentvolumeclaims"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RETRY_BASE_S = 1.0


@pytest.fixture()
def operator(api: kubernetes.client.ApiClient) -> Iterator[Any]:
    """The operator with a 1 s backoff base after a failed download (60 s in production)."""
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    config = OperatorConfig(resync_interval_s=0.5, cache_retry_base_s=RETRY_BASE_S)
    with operator_thread(build_registry(config), memo=memo):
        yield memo


def cr(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}  # fmt: skip


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def deployments_of(kube: KubeClient, name: str) -> dict[str, dict[str, Any]]:
    runtime = f"serving.hpi.dev/inference-deployment={name},app.kubernetes.io/component=inference"  # not the router
    listing = kube.request("GET", f"{DEPLOYMENTS}?labelSelector={runtime}")
    return {d["metadata"]["name"]: d for d in listing["items"]}


async def mark_ready(api: AsyncApi, deployment: dict[str, Any]) -> None:
    """Play the Deployment controller: every replica of the latest template is up and ready."""
    replicas = deployment["spec"]["replicas"]
    status = {"observedGeneration": deployment["metadata"]["generation"], "replicas": replicas,
              "readyReplicas": replicas, "updatedReplicas": replicas, "availableReplicas": replicas}  # fmt: skip
    await api.patch(f"{DEPLOYMENTS}/{deployment['metadata']['name']}/status", {"status": status})


def jobs(kube: KubeClient, kind: str = "fill") -> dict[str, dict[str, Any]]:
    listing = kube.request("GET", f"{JOBS}?labelSelector=serving.hpi.dev/cache-job={kind}")
    return {j["metadata"]["name"]: j for j in listing["items"]}


def one_job(kube: KubeClient, kind: str = "fill") -> dict[str, Any] | None:
    found = jobs(kube, kind)
    return next(iter(found.values())) if len(found) == 1 else None


async def finish(api: AsyncApi, job: dict[str, Any], ok: bool, message: str = "") -> None:
    """Play the Job controller: the Job completed, or failed after its pod retries."""
    kind = "Complete" if ok else "Failed"
    cond = {"type": kind, "status": "True", "reason": "" if ok else "BackoffLimitExceeded",
            "message": message, "lastTransitionTime": "2026-01-01T00:00:00Z" if ok else _now()}  # fmt: skip
    status = {"conditions": [cond], "succeeded" if ok else "failed": 1 if ok else 4}
    await api.patch(f"{JOBS}/{job['metadata']['name']}/status", {"status": status})


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def events(kube: KubeClient, reason: str) -> list[dict[str, Any]]:
    items = kube.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
    return [e for e in items if e["reason"] == reason and e["involvedObject"]["name"] == "cached"]


def served_dir(kube: KubeClient) -> str:
    """The --model directory of the (one) runtime Deployment."""
    [deployment] = deployments_of(kube, "cached").values()
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--model") + 1]


async def test_cache_is_filled_once_then_pods_start_and_failures_retry(kube: KubeClient, operator: Any) -> None:
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    await api.call("POST", CRS, cr("cached", {
        "replicas": 2,
        "model": {"source": "huggingface", "huggingface": {"id": MODEL, "tokenSecretRef": {"name": "hf"}},
                  "cache": {"enabled": True, "storageClassName": "nfs"}},
    }))  # fmt: skip

    # A claim sized from the checkpoint and one Job that downloads into it; no runtime pod before it is done.
    pvc = await eventually(lambda: kube.get(f"{PVCS}/cached-model-cache"))
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Gi"  # 2 x 0.27 GB of bf16 + 10%, in whole GiB
    first = await eventually(lambda: one_job(kube))
    download = first["spec"]["template"]["spec"]["containers"][0]
    revision_dir = f"/model-cache/models/{MODEL}/main"
    assert download["args"][:3] == ["fetch", MODEL, revision_dir]
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "cached-model-cache"}} in (
        first["spec"]["template"]["spec"]["volumes"]
    )
    assert {e["name"] for e in download["env"]} >= {"HF_TOKEN"}
    body = await eventually(lambda: condition(b := kube.get(f"{CRS}/cached"), "ModelCached") and b)
    assert condition(body, "ModelCached")["reason"] == "DownloadPending"
    assert condition(body, "Ready")["reason"] == "WaitingForModelCache"
    assert body["status"]["modelCache"]["phase"] == "Pending" and "servedPath" not in body["status"]["modelCache"]
    assert await asyncio.to_thread(deployments_of, kube, "cached") == {}

    # The download fails (after the Job controller's own pod retries): condition, one Event, no pods; the
    # operator replaces the Job after its backoff, as attempt 2.
    await finish(api, first, ok=False, message="Job has reached the specified backoff limit")
    [event] = await eventually(lambda: events(kube, "DownloadFailed"))
    assert event["type"] == "Warning" and "attempt 1 failed" in event["message"] and "backoff limit" in event["message"]
    body = await eventually(lambda: (b := kube.get(f"{CRS}/cached"))["status"]["modelCache"].get("lastFailure") and b)
    assert "attempt 1 failed" in body["status"]["modelCache"]["lastFailure"]
    assert (
        condition(body, "ModelCached")["status"] == "False"
        and "attempt 1 failed" in (condition(body, "ModelCached")["message"])
    )
    assert await asyncio.to_thread(deployments_of, kube, "cached") == {}
    second = await eventually(lambda: (j := one_job(kube)) and j["metadata"]["uid"] != first["metadata"]["uid"]
                              and j)  # fmt: skip
    assert second["metadata"]["annotations"]["serving.hpi.dev/cache-attempt"] == "2"
    assert second["metadata"]["name"] == first["metadata"]["name"]
    await eventually(lambda: kube.get(f"{CRS}/cached")["status"]["modelCache"]["attempt"] == 2)
    assert len(await asyncio.to_thread(events, kube, "DownloadFailed")) == 1  # per attempt, not per resync

    # Attempt 2 completes: the Deployment appears, reading the claim read-only behind a completeness check.
    await finish(api, second, ok=True)
    [deployment] = (await eventually(lambda: deployments_of(kube, "cached"))).values()
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == revision_dir
    mount = {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True}
    assert mount in pod["containers"][0]["volumeMounts"]
    [check] = pod["initContainers"]
    assert check["args"] == ["check", revision_dir]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "cached-model-cache"}} in pod["volumes"]
    assert "HF_TOKEN" not in {e["name"] for e in pod["containers"][0]["env"]}  # only the Job needs the token
    body = await eventually(lambda: condition(b := kube.get(f"{CRS}/cached"), "ModelCached").get("status")
                            == "True" and b)  # fmt: skip
    assert body["status"]["modelCache"]["servedPath"] == revision_dir
    assert "lastFailure" not in body["status"]["modelCache"]  # cleared by the success
    await eventually(lambda: events(kube, "ModelCached"))  # posted by kopf's event queue, after the status patch


async def test_revision_change_downloads_beside_and_removes_the_old_revision(kube: KubeClient, operator: Any) -> None:
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    model = {"source": "huggingface", "huggingface": {"id": MODEL, "revision": "v1"}, "cache": {"enabled": True}}
    await api.call("POST", CRS, cr("cached", {"replicas": 1, "model": model}))
    await finish(api, await eventually(lambda: one_job(kube)), ok=True)
    old_dir, new_dir = f"/model-cache/models/{MODEL}/v1", f"/model-cache/models/{MODEL}/v2"
    await eventually(lambda: deployments_of(kube, "cached") and served_dir(kube) == old_dir)
    [deployment] = (await asyncio.to_thread(deployments_of, kube, "cached")).values()
    await mark_ready(api, deployment)
    await eventually(lambda: condition(kube.get(f"{CRS}/cached"), "Ready").get("status") == "True")

    # A new revision: a new Job fills a new directory; the running pods are left on the old one meanwhile.
    await api.patch(f"{CRS}/cached", {"spec": {"model": {"huggingface": {"revision": "v2"}}}})
    job = await eventually(lambda: (j := one_job(kube)) and j["spec"]["template"]["spec"]["containers"][0]["args"][2]
                           == new_dir and j)  # fmt: skip
    body = await eventually(lambda: (b := kube.get(f"{CRS}/cached"))["status"]["modelCache"]["path"] == new_dir and b)
    assert body["status"]["modelCache"]["servedPath"] == old_dir
    assert "pods keep serving" in condition(body, "ModelCached")["message"]
    assert condition(body, "Ready")["status"] == "True"
    assert await asyncio.to_thread(served_dir, kube) == old_dir

    # Complete: the pods roll onto the new directory; the old one stays until the rollout has finished.
    await finish(api, job, ok=True)
    rolled = await eventually(lambda: (d := list(deployments_of(kube, "cached").values())[0])
                              ["spec"]["template"]["spec"]["containers"][0]["args"].count(new_dir) and d)  # fmt: skip
    body = await eventually(lambda: (b := kube.get(f"{CRS}/cached"))["status"]["modelCache"].get("previousPath") and b)
    assert body["status"]["modelCache"]["previousPath"] == old_dir
    assert await asyncio.to_thread(jobs, kube, "remove") == {}  # old pods may still read it
    await mark_ready(api, rolled)
    remover = await eventually(lambda: one_job(kube, "remove"))
    assert remover["spec"]["template"]["spec"]["containers"][0]["args"] == ["remove", old_dir]
    await finish(api, remover, ok=True)
    await eventually(lambda: kube.get(f"{CRS}/cached")["status"]["modelCache"].get("previousPath") is None)
    await eventually(lambda: jobs(kube, "remove") == {})
