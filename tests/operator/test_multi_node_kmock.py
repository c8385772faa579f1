"""A pool whose replicas span nodes, with the real kopf operator against the API emulator over HTTP: first in a
cluster without LeaderWorkerSet (a condition and an Event, the rest still applied), then with LWS's published CRD
installed through the API, as `kubectl apply` would (the emulator then serves the API and validates every write
against LWS's own schema: tests/operator/data/leaderworkerset-v1-crd.json, see test_multi_node.py), scaled
through the InferenceDeployment and read back through the LeaderWorkerSet's scale subresource, and pruned when
the model fits one node again. The emulator runs no LWS controller: the test writes the LeaderWorkerSet's status
as it would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpi_operator.kube import KubeClient
from hpi_testing.cluster_state import AsyncApi
from hpi_testing.kube_emulator import eventually, make_node

pytestmark = pytest.mark.slow

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
LWS = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
LWS_CRD = json.loads((Path(__file__).parent / "data" / "leaderworkerset-v1-crd.json").read_text())
L40S_X4 = ("NVIDIA-L40S", 46068, 4)
LLAMA_405B = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-405B-Instruct"}}
LLAMA_8B = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}}


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def cr(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}  # fmt: skip


async def test_a_group_pool_without_lws_then_with_it_scaled_and_pruned(kube: KubeClient, operator: Any) -> None:
    api = AsyncApi(kube)
    for i in range(4):
        await api.call("POST", "/api/v1/nodes", make_node(f"l40s-{i}", gpu=L40S_X4))
    spec = {"replicas": 1, "model": LLAMA_405B, "placement": {"maxNodesPerReplica": 4}}
    await api.call("POST", CRS, cr("big", spec))

    # No LWS API: said in a condition and an Event; the Service and the PDB are applied all the same.
    degraded = await eventually(lambda: (c := condition(kube.get(f"{CRS}/big"), "Degraded")).get("reason") ==
                                "LeaderWorkerSetNotInstalled" and c)  # fmt: skip
    assert degraded["status"] == "True" and "install LWS" in degraded["message"]
    events = await eventually(lambda: [e for e in kube.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
                                       if e["reason"] == "LeaderWorkerSetNotInstalled"])  # fmt: skip
    assert events[0]["type"] == "Warning"
    assert await api.get(f"/api/v1/namespaces/{NS}/services/big") is not None
    assert await api.get(f"{LWS}/big-gpu-l40s") is None

    # LWS installed: the group's LeaderWorkerSet appears, accepted by LWS's schema (the emulator validates it).
    await api.call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", LWS_CRD)
    lws = await eventually(lambda: kube.get(f"{LWS}/big-gpu-l40s"))
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and lws["spec"]["replicas"] == 1
    assert "--pipeline-parallel-size" in template["leaderTemplate"]["spec"]["containers"][0]["args"]
    status = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
              "observedGeneration": lws["metadata"]["generation"]}  # fmt: skip
    await api.patch(f"{LWS}/big-gpu-l40s/status", {"status": status})
    await eventually(lambda: condition(kube.get(f"{CRS}/big"), "Ready").get("status") == "True")
    status = (await api.get(f"{CRS}/big"))["status"]
    assert condition({"status": status}, "Degraded")["status"] == "False"
    pools = status["pools"]
    assert [(p["nodesPerReplica"], p["gpusPerReplica"]) for p in pools if p.get("profile")] == [(2, 8)]

    # Scaled through the InferenceDeployment's scale subresource (as an HPA would): the groups follow, and LWS's
    # own scale subresource (what `kubectl scale` and HPAs read) shows them.
    await api.patch(f"{CRS}/big/scale", {"spec": {"replicas": 2}})
    await eventually(lambda: kube.get(f"{LWS}/big-gpu-l40s")["spec"]["replicas"] == 2)
    scale = await api.call("GET", f"{LWS}/big-gpu-l40s/scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2

    # A model one node holds: a Deployment again, and the LeaderWorkerSet pruned.
    await api.patch(f"{CRS}/big", {"spec": {"model": LLAMA_8B}})
    await eventually(lambda: kube.get(f"{LWS}/big-gpu-l40s") is None)
    deployment = await api.get(f"{DEPLOYMENTS}/big-gpu-l40s")
    assert deployment is not None and deployment["spec"]["replicas"] == 2
