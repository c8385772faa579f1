"""The real kopf operator against the kmock-based API emulator over HTTP.

Every assertion goes through the Kubernetes API (the kubernetes client's transport), as it would against a
real cluster. The emulator runs no controllers: tests play the Deployment controller by patching
/status, and create Node objects as GFD/NFD would label them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from hpi_operator import reconcile as reconcile_module
from hpi_operator.kube import KubeClient, KubeError
from hpi_testing.cluster_state import AsyncApi, operator_write_records, reconciles
from hpi_testing.kube_emulator import H100, L4, eventually, finished_job_pod, finished_job_status, make_node

pytestmark = pytest.mark.slow

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
LWS_CRD = json.loads((Path(__file__).parent / "data" / "leaderworkerset-v1-crd.json").read_text())


def cr(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}  # fmt: skip


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return cond
    return {}


def deployments_of(kube: KubeClient, name: str) -> dict[str, dict[str, Any]]:
    """The runtime Deployments (one per pool) of `name`; the router's or endpoint picker's are other components."""
    selector = f"serving.hpi.dev/inference-deployment={name},app.kubernetes.io/component=inference"
    listing = kube.request("GET", f"{DEPLOYMENTS}?labelSelector={selector}")
    return {d["metadata"]["name"]: d for d in listing["items"]}


async def mark_ready(api: AsyncApi, deployment: dict[str, Any]) -> None:
    """Play the Deployment controller: every replica of the latest template is up and ready."""
    replicas = deployment["spec"]["replicas"]
    status = {"observedGeneration": deployment["metadata"]["generation"], "replicas": replicas,
              "readyReplicas": replicas, "updatedReplicas": replicas, "availableReplicas": replicas}  # fmt: skip
    await api.patch(f"{DEPLOYMENTS}/{deployment['metadata']['name']}/status", {"status": status})


async def test_create_builds_children_per_pool_and_reports_status(kube: KubeClient, operator: Any) -> None:
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    await api.call("POST", "/api/v1/nodes", make_node("cpu-0", bf16=True, memory="32Gi"))
    await api.call("POST", "/api/v1/nodes", make_node("cpu-down", ready=False))
    created = await api.call("POST", CRS, cr("llama", {
        "replicas": 3,
        "model": {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}},
    }))  # fmt: skip

    found = await eventually(lambda: len(deployments_of(kube, "llama")) == 2 and deployments_of(kube, "llama"))
    gpu, cpu = found["llama-gpu-l4"], found["llama-cpu-amd64-bf16"]
    args = gpu["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--dtype") + 1] == "bfloat16" and args[args.index("--device") + 1] == "cuda"
    assert gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert cpu["spec"]["template"]["spec"]["containers"][0]["args"][-1] != "cuda"
    assert gpu["spec"]["replicas"] + cpu["spec"]["replicas"] == 3
    # One apply pass writes the children one by one: the budget may land a moment after the Deployments.
    service = await eventually(lambda: kube.get(f"/api/v1/namespaces/{NS}/services/llama"))
    pdb = await eventually(lambda: kube.get(f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/llama"))
    for child in (gpu, cpu, service, pdb):
        [ref] = child["metadata"]["ownerReferences"]
        assert ref["uid"] == created["metadata"]["uid"] and ref["controller"] is True

    body = await eventually(lambda: condition(kube.get(f"{CRS}/llama"), "Progressing") and kube.get(f"{CRS}/llama"))
    status = body["status"]
    assert status["observedGeneration"] == body["metadata"]["generation"]
    assert status["selector"] == "serving.hpi.dev/inference-deployment=llama"
    assert condition(body, "Ready")["status"] == "False"
    assert condition(body, "Progressing")["reason"] == "RollingOut"
    assert {p["name"]: p["profile"] for p in status["pools"]} == {"gpu-l4": "cuda:bf16", "cpu-amd64-bf16": "cpu:bf16"}

    # The Deployment controller's part: pods become ready; the operator's resync picks it up.
    for deployment in found.values():
        await mark_ready(api, deployment)
    body = await eventually(lambda: condition(kube.get(f"{CRS}/llama"), "Ready").get("status") == "True"
                            and kube.get(f"{CRS}/llama"))  # fmt: skip
    assert body["status"]["readyReplicas"] == 3
    assert condition(body, "Progressing")["status"] == "False"
    # Capacity: one L4 GPU and one CPU node hold 2 of the 3 replicas; the third waits Pending.
    assert condition(body, "Degraded")["reason"] == "InsufficientCapacity"

    events = await api.call("GET", f"/api/v1/namespaces/{NS}/events")
    reasons = {e["reason"] for e in events["items"] if e["involvedObject"]["name"] == "llama"}
    assert {"Applied", "InsufficientCapacity"} <= reasons


async def test_update_replicas_patches_only_what_changed(kube: KubeClient, operator: Any) -> None:
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("gpu-h100-0", gpu=H100))
    # Routing pinned to a plain Service: the default would switch to the router at 4 replicas (test_routing_kmock).
    await api.call("POST", CRS, cr("demo", {"replicas": 1, "routing": {"mode": "service"}}))
    first = await eventually(lambda: deployments_of(kube, "demo").get("demo-gpu-h100-80gb-hbm3"))
    assert first["spec"]["replicas"] == 1
    await eventually(lambda: (kube.get(f"{CRS}/demo").get("status") or {}).get("observedGeneration") == 1)
    service_rv = (await api.get(f"/api/v1/namespaces/{NS}/services/demo"))["metadata"]["resourceVersion"]

    await api.patch(f"{CRS}/demo", {"spec": {"replicas": 4}})
    updated = await eventually(lambda: (d := deployments_of(kube, "demo")["demo-gpu-h100-80gb-hbm3"])
                               ["spec"]["replicas"] == 4 and d)  # fmt: skip
    assert updated["metadata"]["generation"] == first["metadata"]["generation"] + 1
    body = await eventually(lambda: (b := kube.get(f"{CRS}/demo"))["status"].get("observedGeneration") == 2 and b)
    assert body["metadata"]["generation"] == 2
    service = await api.get(f"/api/v1/namespaces/{NS}/services/demo")
    assert service["metadata"]["resourceVersion"] == service_rv  # unchanged children are never written

    # A placement change (pin int8) rolls the template: new args, same Deployment.
    await api.patch(f"{CRS}/demo", {"spec": {"placement": {"profile": {"quantization": "int8"}}}})
    rolled = await eventually(lambda: "int8" in deployments_of(kube, "demo")["demo-gpu-h100-80gb-hbm3"]
                              ["spec"]["template"]["spec"]["containers"][0]["args"]
                              and deployments_of(kube, "demo")["demo-gpu-h100-80gb-hbm3"])  # fmt: skip
    assert rolled["spec"]["replicas"] == 4

    # A model change rolls the same Deployment onto the new weights and name; the Service is not rewritten.
    model = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}, "servedName": "llama"}
    await api.patch(f"{CRS}/demo", {"spec": {"model": model}})
    # deployments_of() blocks: inside eventually() it runs off the loop that serves the emulator.
    children = await eventually(lambda: (d := deployments_of(kube, "demo")) and "llama" in
                                d["demo-gpu-h100-80gb-hbm3"]["spec"]["template"]["spec"]["containers"][0]["args"]
                                and d)  # fmt: skip
    assert set(children) == {"demo-gpu-h100-80gb-hbm3"}
    args = children["demo-gpu-h100-80gb-hbm3"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--served-model-name") + 1] == "llama"
    assert args[args.index("--model") + 1].endswith("/models/meta-llama/Llama-3.1-8B-Instruct")
    service = await api.get(f"/api/v1/namespaces/{NS}/services/demo")
    assert service["metadata"]["resourceVersion"] == service_rv


async def test_model_too_big_for_one_gpu_runs_tensor_parallel(kube: KubeClient, operator: Any) -> None:
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("gpu-a4000-0", gpu=("NVIDIA-RTX-A4000", 16376, 2)))
    await api.call("POST", CRS, cr("tp", {
        "model": {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}},
        "placement": {"maxGpusPerReplica": 2},
    }))  # fmt: skip
    [dep] = (await eventually(lambda: deployments_of(kube, "tp"))).values()
    main = dep["spec"]["template"]["spec"]["containers"][0]
    assert main["args"][main["args"].index("--tensor-parallel-size") + 1] == "2"
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "2"
    body = await eventually(lambda: (b := kube.get(f"{CRS}/tp")) and (b.get("status") or {}).get("pools") and b)
    [pool] = body["status"]["pools"]
    assert (pool["profile"], pool["gpusPerReplica"]) == ("cuda:bf16 x2", 2)
    assert "tensor parallel over 2 GPUs: 1 x NVIDIA-RTX-A4000 is not enough" in pool["reason"]


async def test_node_pool_appearing_and_vanishing(kube: KubeClient, operator: Any) -> None:
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    await api.call("POST", CRS, cr("grow", {"replicas": 2}))
    await eventually(lambda: set(deployments_of(kube, "grow")) == {"grow-cpu-amd64-bf16"})

    # A GPU pool joins: the resync notices the inventory changed the plan, and adds a Deployment.
    await api.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    both = await eventually(lambda: len(d := deployments_of(kube, "grow")) == 2 and d)
    assert both["grow-gpu-l4"]["spec"]["replicas"] >= 1  # GPU pools rank first
    body = await eventually(lambda: len((b := kube.get(f"{CRS}/grow"))["status"].get("pools", [])) == 2 and b)
    assert {p["name"] for p in body["status"]["pools"]} == {"gpu-l4", "cpu-amd64-bf16"}

    # The GPU node goes NotReady: its pool leaves the inventory and its Deployment is pruned.
    await api.patch("/api/v1/nodes/gpu-l4-0/status", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    await eventually(lambda: set(deployments_of(kube, "grow")) == {"grow-cpu-amd64-bf16"})
    remaining = await asyncio.to_thread(deployments_of, kube, "grow")
    assert remaining["grow-cpu-amd64-bf16"]["spec"]["replicas"] == 2

    # A node deleted outright (scale-in of a node group) counts the same.
    await api.call("POST", "/api/v1/nodes", make_node("gpu-h100-0", gpu=H100))
    await eventually(lambda: "grow-gpu-h100-80gb-hbm3" in deployments_of(kube, "grow"))
    await api.call("DELETE", "/api/v1/nodes/gpu-h100-0")
    await eventually(lambda: "grow-gpu-h100-80gb-hbm3" not in deployments_of(kube, "grow"))


@pytest.mark.parametrize("broken", [False, True], ids=["operator", "broken-event-every-pass"])
async def test_bad_specs_degrade_with_an_event_and_recover(
    kube: KubeClient, operator: Any, emulator: Any, monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    # 70B unquantized cannot fit a 24 GB L4: no pool can serve it.
    await api.call("POST", CRS, cr("huge", {
        "model": {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-70B-Instruct"}},
        "placement": {"profile": {"quantization": "none"}},
    }))  # fmt: skip
    body = await eventually(lambda: condition(b := kube.get(f"{CRS}/huge"), "Degraded").get("status") == "True" and b)
    degraded = condition(body, "Degraded")
    assert degraded["reason"] == "NoFittingPool" and "gpu-l4" in degraded["message"]
    assert await asyncio.to_thread(deployments_of, kube, "huge") == {}

    def warning_events() -> list[dict[str, Any]]:
        items = kube.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
        return [e for e in items if e["involvedObject"]["name"] == "huge" and e["type"] == "Warning"]

    await eventually(lambda: any(e["reason"] == "NoFittingPool" for e in warning_events()))

    # A spec the schema cannot catch: source pvc without the claim.
    await api.patch(f"{CRS}/huge", {"spec": {"model": {"source": "pvc"}}})
    body = await eventually(lambda: condition(b := kube.get(f"{CRS}/huge"), "Degraded").get("reason") == "InvalidSpec"
                            and b)  # fmt: skip
    assert "claimName" in condition(body, "Degraded")["message"]
    await eventually(lambda: any(e["reason"] == "InvalidSpec" for e in warning_events()))
    if broken:  # an operator that forgets it has reported the cause: an Event on every pass
        monkeypatch.setattr(reconcile_module, "_reported", lambda old_status, message: False)
    # Three more passes over the same bad spec: no duplicate Event, and nothing else written either.
    since, start = len(emulator.writes), reconciles(operator, "invalid")
    await eventually(lambda: reconciles(operator, "invalid") >= start + 3)

    def reported_once() -> None:
        num_events = sum(e["reason"] == "InvalidSpec" for e in warning_events())
        assert num_events == 1, f"{num_events} InvalidSpec Events"
        assert operator_write_records(emulator, since, stored_only=True) == []

    if broken:
        with pytest.raises(AssertionError, match="InvalidSpec Events"):
            await asyncio.to_thread(reported_once)
        return
    await asyncio.to_thread(reported_once)

    # Fixing the spec recovers.
    await api.patch(f"{CRS}/huge", {"spec": {"model": {"source": "embedded", "huggingface": None},
                                             "placement": None}})  # fmt: skip
    body = await eventually(lambda: condition(b := kube.get(f"{CRS}/huge"), "Degraded").get("status") == "False"
                            and b)  # fmt: skip
    assert set(await asyncio.to_thread(deployments_of, kube, "huge")) == {"huge-gpu-l4"}
    assert body["status"]["observedGeneration"] == body["metadata"]["generation"]


async def test_deleting_the_resource_releases_its_children(kube: KubeClient, operator: Any) -> None:
    """Owner references do the cleanup (the emulator collects garbage as the API server's GC would)."""
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("cpu-0"))
    await api.call("POST", CRS, cr("gone", {}))
    await eventually(lambda: deployments_of(kube, "gone"))
    await api.call("DELETE", f"{CRS}/gone")
    await eventually(lambda: kube.get(f"{CRS}/gone") is None)  # the operator released its finalizer
    await eventually(lambda: deployments_of(kube, "gone") == {})
    assert await api.get(f"/api/v1/namespaces/{NS}/services/gone") is None


async def test_emulator_answers_like_an_api_server(kube: KubeClient, emulator: Any) -> None:
    """The emulator behaviours the operator relies on (so a kmock upgrade cannot silently change them)."""
    api = AsyncApi(kube)
    node = await api.call("POST", "/api/v1/nodes", make_node("n"))
    assert node["metadata"]["uid"] and int(node["metadata"]["resourceVersion"]) > 0
    with pytest.raises(KubeError) as conflict:
        await api.call("POST", "/api/v1/nodes", make_node("n"))
    assert conflict.value.status == 409
    with pytest.raises(KubeError) as failed_test:
        await api.call("PATCH", "/api/v1/nodes/n", [{"op": "test", "path": "/metadata/name", "value": "x"}],
                       "application/json-patch+json")  # fmt: skip
    assert failed_test.value.status == 422
    listing = await api.call("GET", "/api/v1/nodes?labelSelector=kubernetes.io/hostname=n")
    assert int(listing["metadata"]["resourceVersion"]) >= int(node["metadata"]["resourceVersion"])
    assert [n["metadata"]["name"] for n in listing["items"]] == ["n"]
    assert (await api.call("GET", "/api/v1/nodes?labelSelector=kubernetes.io/hostname=other"))["items"] == []


def rbac_requests(emulator: Any) -> list[tuple[str, str, str, str]]:
    """(user agent, apiGroup, resource[/subresource], verb) of every request the emulator served."""
    calls = []
    for request in list(emulator):
        if request.resource is None or request.resource.plural is None:
            continue  # discovery (/api, /apis/...) is allowed to every authenticated user
        method = str(getattr(request.method, "value", request.method)).upper()
        if method == "GET":
            verb = "watch" if request.params.get("watch") == "true" else ("get" if request.name else "list")
        else:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
        calls.append((agent, request.resource.group, resource, verb))
        if "apply-patch" in request.headers.get("Content-Type", ""):
            calls.append((agent, request.resource.group, resource, "create"))  # an apply may create: both verbs
    return calls


async def test_rbac_rules_cover_every_call_the_operator_makes(emulator: Any, kube: KubeClient, operator: Any) -> None:
    from hpi_operator import rbac

    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    await api.call("POST", "/api/v1/nodes", make_node("gpu-0", gpu=L4))
    await api.call("POST", CRS, cr("audit", {"replicas": 2, "apiKeySecretRef": {"name": "k"}}))
    found = await eventually(lambda: len(d := deployments_of(kube, "audit")) == 2 and d)
    for deployment in found.values():
        await mark_ready(api, deployment)
    await eventually(lambda: condition(kube.get(f"{CRS}/audit"), "Ready").get("status") == "True")
    await api.patch(f"{CRS}/audit", {"spec": {"replicas": 3, "model": {"servedName": "renamed"}}})
    await api.patch(f"{CRS}/audit", {"metadata": {"labels": {"team": "search"}}})  # children inherit labels
    await eventually(lambda: (kube.get(f"/api/v1/namespaces/{NS}/services/audit")["metadata"]["labels"]
                              .get("team") == "search"))  # fmt: skip
    await eventually(lambda: sum(d["spec"]["replicas"] for d in deployments_of(kube, "audit").values()) == 3)
    # The external autoscaler modes: an HPA, then a ScaledObject (the HPA pruned), then neither.
    hpa = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/audit"
    scaled_object = f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects/audit"
    for change, check in (
        ({"enabled": True, "mode": "hpa"}, lambda: kube.get(hpa)),
        ({"maxReplicas": 6}, lambda: (kube.get(hpa) or {}).get("spec", {}).get("maxReplicas") == 6),
        ({"mode": "keda"}, lambda: kube.get(hpa) is None and kube.get(scaled_object)),
        ({"maxReplicas": 5}, lambda: (kube.get(scaled_object) or {}).get("spec", {}).get("maxReplicaCount") == 5),
        ({"enabled": False}, lambda: kube.get(scaled_object) is None),
    ):
        await api.patch(f"{CRS}/audit", {"spec": {"autoscaling": change}})
        await eventually(check)
    # Routing: the default router (2 replicas), then an InferencePool (the router's objects pruned), then a Service.
    pool = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/audit"
    router_role = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/audit-router"
    for routing, check in (
        ({"mode": "inferencePool"}, lambda: kube.get(pool) and kube.get(router_role) is None),
        (
            {"inferencePool": {"failureMode": "FailClose"}},
            lambda: kube.get(pool)["spec"]["endpointPickerRef"]["failureMode"] == "FailClose",
        ),
        ({"mode": "service"}, lambda: kube.get(pool) is None and kube.get(f"{DEPLOYMENTS}/audit-epp") is None),
    ):
        await api.patch(f"{CRS}/audit", {"spec": {"routing": routing}})
        await eventually(check)
    # spec.networkPolicy: the runtime pods' policy, changed in place (new scrapers), then pruned.
    policy = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/audit-runtime"
    scrapers = [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    for change, check in (
        ({"enabled": True}, lambda: kube.get(policy)),
        ({"prometheus": scrapers}, lambda: scrapers[0] in kube.get(policy)["spec"]["ingress"][0]["from"]),
        ({"enabled": False}, lambda: kube.get(policy) is None),
    ):
        await api.patch(f"{CRS}/audit", {"spec": {"networkPolicy": change}})
        await eventually(check)
    # spec.placement.profiling: a Job per pool; one completes (its pod read, the cache written); never: the pools'
    # profile ConfigMaps pruned.
    jobs = f"/apis/batch/v1/namespaces/{NS}/jobs"
    configmaps = f"/api/v1/namespaces/{NS}/configmaps"
    await api.patch(f"{CRS}/audit", {"spec": {"placement": {"profiling": "always"}}})
    profiling = await eventually(lambda: [j for j in kube.request("GET", jobs)["items"] if "-profile-gpu" in
                                          j["metadata"]["name"]])  # fmt: skip
    pod, pod_status = finished_job_pod(profiling[0], '{"itlAlphaMs":9,"itlBetaMs":0.3,"prefillTokensPerSecond":'
                                                     '5000,"maxNumSeqs":100}')  # fmt: skip
    await api.call("POST", f"/api/v1/namespaces/{NS}/pods", pod)
    await api.patch(f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}/status", pod_status)
    await api.patch(f"{jobs}/{profiling[0]['metadata']['name']}/status", finished_job_status(True))
    await eventually(lambda: [c for c in kube.request("GET", configmaps)["items"]
                              if c["metadata"]["name"].startswith("hpi-pool-profile-")])  # fmt: skip
    await api.patch(f"{CRS}/audit", {"spec": {"placement": {"profiling": "never"}}})
    await eventually(lambda: not [c for c in kube.request("GET", configmaps)["items"]
                                  if c["metadata"]["name"].startswith("audit-")])  # fmt: skip
    await api.call("DELETE", "/api/v1/nodes/gpu-0")
    await eventually(lambda: len(deployments_of(kube, "audit")) == 1)
    # A pool whose replicas span nodes: a LeaderWorkerSet once LWS is installed, pruned when one node is enough again.
    await api.call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", LWS_CRD)
    await api.call("POST", "/api/v1/nodes", make_node("cpu-1", bf16=True))
    groups = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets?labelSelector=" \
             "serving.hpi.dev/inference-deployment=audit"  # fmt: skip
    await api.patch(f"{CRS}/audit", {"spec": {"parallelism": {"pipeline": 2}}})
    await eventually(lambda: kube.request("GET", groups)["items"])
    await api.patch(f"{CRS}/audit", {"spec": {"parallelism": None}})
    await eventually(lambda: not kube.request("GET", groups)["items"] and len(deployments_of(kube, "audit")) == 1)
    # spec.model.cache: a claim and a fill Job; a revision change replaces the Job, a size change patches the claim.
    pvc = f"/api/v1/namespaces/{NS}/persistentvolumeclaims/audit-model-cache"
    hub_model = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    model = {"source": "huggingface", "huggingface": hub_model, "cache": {"enabled": True}}
    await api.patch(f"{CRS}/audit", {"spec": {"model": model}})
    await eventually(lambda: kube.request("GET", jobs)["items"])
    await api.patch(f"{CRS}/audit", {"spec": {"model": {"huggingface": {"revision": "v2"}, "cache": {"size": "3Gi"}}}})
    await eventually(lambda: [j["spec"]["template"]["spec"]["containers"][0]["args"][2].rsplit("/", 1)[-1]
                              for j in kube.request("GET", jobs)["items"]] == ["v2"])  # fmt: skip
    await eventually(lambda: kube.get(pvc)["spec"]["resources"]["requests"]["storage"] == "3Gi")
    await api.patch(f"{CRS}/audit", {"spec": {"model": {"source": "pvc"}}})  # an Event for the bad spec
    await eventually(lambda: condition(kube.get(f"{CRS}/audit"), "Degraded").get("reason") == "InvalidSpec")
    await api.call("DELETE", f"{CRS}/audit")
    await eventually(lambda: kube.get(f"{CRS}/audit") is None)

    calls = rbac_requests(emulator)
    operator_calls = {c[1:] for c in calls if c[0].startswith(("hpi-operator/", "kopf/"))}
    uncovered = sorted(c for c in operator_calls if not rbac.allowed(*c))
    assert not uncovered, f"API calls outside rbac.RULES: {uncovered}"
    # The builtin autoscaler's scale writes are exercised in test_autoscale_kmock.py, not here.
    granted = {(r.api_group, r.resource, verb) for r in rbac.RULES if not (r.only_when or r.delegated)
               for verb in r.verbs if not r.resource.endswith("/scale")}  # fmt: skip
    assert not granted - operator_calls, f"rules granting calls the operator never made: {granted - operator_calls}"
    assert {c[0].split("/")[0] for c in calls} >= {"hpi-operator", "kopf"}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except OSError:
        return 0, ""


async def test_cli_run_serves_liveness_and_metrics_and_reconciles(kube: KubeClient, tmp_path: Any) -> None:
    """`hpi-operator run` as a process, as the chart's Deployment runs it (KUBECONFIG instead of in-cluster)."""
    import os
    import signal
    import sys

    liveness, metrics = free_port(), free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hpi_operator.cli", "run", "--liveness", f"http://127.0.0.1:{liveness}/healthz",
        "--metrics-port", str(metrics), "--resync-interval", "1",
        env={**os.environ}, stdout=asyncio.subprocess.DEVNULL, stderr=open(tmp_path / "operator.log", "wb"),
    )  # fmt: skip
    try:
        await eventually(lambda: http_get(f"http://127.0.0.1:{liveness}/healthz")[0] == 200, timeout_s=30)
        api = AsyncApi(kube)
        await api.call("POST", "/api/v1/nodes", make_node("cpu-0"))
        await api.call("POST", CRS, cr("cli", {}))
        await eventually(lambda: deployments_of(kube, "cli"))
        applied = 'hpi_operator_reconciles_total{result="applied"}'
        text = await eventually(lambda: applied in (t := http_get(f"http://127.0.0.1:{metrics}/metrics")[1]) and t)
        assert 'hpi_operator_nodes{kind="cpu"} 1.0' in text
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(process.wait(), 20)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            process.kill()
            raise
    assert code == 0, (tmp_path / "operator.log").read_text()[-3000:]
