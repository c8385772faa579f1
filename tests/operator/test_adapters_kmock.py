"""spec.adapters end to end: the real kopf operator against the kmock-based API emulator downloads a Hugging Face
adapter by a Job onto the model cache, lists the available adapters in the ConfigMap a starting pod loads, loads
them on the running pod through vLLM's admin endpoints, unloads a removed one, and reports a bad one.

The runtime pod is a loopback stand-in (aiohttp) with the runtime's adapter endpoints (GET /v1/models with the
adapters' `parent`, POST /v1/load_lora_adapter and /v1/unload_lora_adapter, vLLM's answers), not a real
`hpi serve`: a real one costs a minute of start-up on 2 cores, and those endpoints are tested against the real
engine in tests/runtime. The test plays the Job controller (it marks the download Job complete).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp.web
import kopf
import kubernetes
import pytest

from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.manifests import common_labels
from hpi_operator.op_metrics import OperatorMetrics
from hpi_testing.cluster_state import AsyncApi
from hpi_testing.kube_emulator import eventually, make_node, operator_thread
from hpi_testing.kube_emulator import runtime_pod as make_runtime_pod
from hpi_testing.server import serving

pytestmark = pytest.mark.slow

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
PODS = f"/api/v1/namespaces/{NS}/pods"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
BAD_DIR = "/model-cache/adapters/broken"


class LoraRuntime:
    """A runtime pod's adapter surface, as vLLM answers it; every call recorded."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.loaded: dict[str, str] = {}
        self.calls: list[str] = []

    def app(self) -> aiohttp.web.Application:
        async def metrics(_: aiohttp.web.Request) -> aiohttp.web.Response:
            return aiohttp.web.Response(text="", content_type="text/plain")

        async def models(_: aiohttp.web.Request) -> aiohttp.web.Response:
            data = [{"id": self.base, "object": "model", "owned_by": "hpi", "root": "/models/base"}]
            data += [{"id": n, "object": "model", "owned_by": "hpi", "root": p, "parent": self.base}
                     for n, p in self.loaded.items()]  # fmt: skip
            return aiohttp.web.json_response({"object": "list", "data": data})

        async def load(request: aiohttp.web.Request) -> aiohttp.web.Response:
            body = await request.json()
            name, path = body["lora_name"], body["lora_path"]
            self.calls.append(f"load {name}")
            if name in self.loaded:
                return _error(400, f"The lora adapter '{name}' has already been loaded.")
            if path == BAD_DIR:
                return _error(400, f"{path}: adapter_config.json is missing")
            self.loaded[name] = path
            return aiohttp.web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

        async def unload(request: aiohttp.web.Request) -> aiohttp.web.Response:
            name = (await request.json())["lora_name"]
            self.calls.append(f"unload {name}")
            if self.loaded.pop(name, None) is None:
                return _error(404, f"The lora adapter '{name}' cannot be found.")
            return aiohttp.web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

        app = aiohttp.web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/load_lora_adapter", load)
        app.router.add_post("/v1/unload_lora_adapter", unload)
        return app


def _error(status: int, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"error": {"message": message, "type": "BadRequestError", "code": status}},
                                     status=status)  # fmt: skip


def job_of(kube: KubeClient, kind: str) -> dict[str, Any] | None:
    """The model cache's Job of `kind` (fill, adapter), if there is one."""
    items = kube.request("GET", f"{JOBS}?labelSelector=serving.hpi.dev/cache-job={kind}")["items"]
    return items[0] if items else None


async def complete(client: AsyncApi, job: dict[str, Any]) -> None:
    """Play the Job controller: the Job completed."""
    cond = {"type": "Complete", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    await client.patch(f"{JOBS}/{job['metadata']['name']}/status", {"status": {"conditions": [cond], "succeeded": 1}})


def adapter_status(kube: KubeClient) -> dict[str, dict[str, Any]]:
    return {a["name"]: a for a in (kube.get(f"{CRS}/lora").get("status") or {}).get("adapters") or []}


def events(kube: KubeClient, reason: str) -> list[str]:
    items = kube.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
    return [e["message"] for e in items if e["reason"] == reason]


async def test_adapters_are_downloaded_listed_loaded_unloaded_and_a_bad_one_reported(
    kube: KubeClient, api: kubernetes.client.ApiClient
) -> None:
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    registry = build_registry(OperatorConfig(resync_interval_s=0.5, adapters_interval_s=0.3))
    client = AsyncApi(kube)
    await client.call("POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    adapters = [{"name": "sql", "source": {"huggingface": {"id": "acme/sql-lora"}}},
                {"name": "chat", "source": {"path": "adapters/chat"}}]  # fmt: skip
    spec = {"replicas": 1,
            "model": {"source": "huggingface", "huggingface": {"id": MODEL}, "cache": {"enabled": True}},
            "adapters": adapters}  # fmt: skip
    context = operator_thread(registry, memo=memo)
    await asyncio.to_thread(context.__enter__)
    try:
        await client.call("POST", CRS, {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
                                        "metadata": {"name": "lora", "namespace": NS}, "spec": spec})  # fmt: skip
        # The model's own download (the test plays the Job controller); the pods start once it is complete.
        await complete(client, await eventually(lambda: job_of(kube, "fill")))
        # The pods are told to serve adapters, and where the starting list is.
        deployment = await eventually(lambda: next(iter(kube.request("GET", DEPLOYMENTS)["items"]), None))
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        assert "--enable-lora" in args and args[args.index("--lora-modules") + 1].startswith("@/etc/hpi/adapters/")
        assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"} in container["env"]
        # One download Job for the Hugging Face adapter, onto the model cache claim.
        job = await eventually(lambda: job_of(kube, "adapter"))
        download = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert download[:3] == ["fetch", "acme/sql-lora", "/model-cache/adapters/acme/sql-lora/main"]
        assert "--adapter" in download

        runtime = LoraRuntime(base=MODEL)
        async with serving(runtime.app()) as port:
            pool = deployment["spec"]["template"]["metadata"]["labels"]["serving.hpi.dev/pool"]
            labels = {**common_labels("lora"), "serving.hpi.dev/pool": pool}
            await client.call("POST", PODS, make_runtime_pod("lora-0", port, labels, NS))
            # The path adapter is available at once and loaded; the Hugging Face one waits for its download.
            await eventually(lambda: adapter_status(kube).get("chat", {}).get("phase") == "Loaded")
            assert runtime.loaded == {"chat": "/model-cache/adapters/chat"}
            assert (await asyncio.to_thread(adapter_status, kube))["sql"]["phase"] == "Downloading"
            configmap = await client.get(f"/api/v1/namespaces/{NS}/configmaps/lora-adapters")
            assert json.loads(configmap["data"][f"{pool}.json"]) == [
                {"name": "chat", "path": "/model-cache/adapters/chat", "base_model_name": MODEL}]

            # The Job completes: the adapter joins the list and the pod.
            await complete(client, job)
            await eventually(lambda: adapter_status(kube).get("sql", {}).get("phase") == "Loaded")
            assert runtime.loaded["sql"] == "/model-cache/adapters/acme/sql-lora/main"
            assert (await asyncio.to_thread(adapter_status, kube))["sql"]["loadedPods"] == 1

            # Removed from the spec: unloaded from the pod, its Job deleted; a bad one added: reported.
            body = await client.get(f"{CRS}/lora")
            body["spec"]["adapters"] = [adapters[1], {"name": "broken", "source": {"path": "adapters/broken"}}]
            await client.call("PUT", f"{CRS}/lora", body)
            await eventually(lambda: "sql" not in runtime.loaded and "sql" not in adapter_status(kube))
            assert "unload sql" in runtime.calls
            await eventually(lambda: job_of(kube, "adapter") is None)
            broken = await eventually(lambda: (a := adapter_status(kube).get("broken")) and a.get("callFailure") and a)
            assert broken["phase"] == "Partial" and "adapter_config.json is missing" in broken["callFailure"]
            assert await eventually(lambda: events(kube, "AdapterLoadFailed"))
            assert runtime.loaded.keys() == {"chat"}
            # Each tick retries the bad one, and the Event is not repeated while the failure stays the same.
            calls = runtime.calls.count("load broken")
            await eventually(lambda: runtime.calls.count("load broken") >= calls + 2)
            assert len(await asyncio.to_thread(events, kube, "AdapterLoadFailed")) == 1
    finally:
        await asyncio.to_thread(context.__exit__, None, None, None)
