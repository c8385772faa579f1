"""Pool profiling under the real kopf operator and the API emulator over HTTP.

The emulator runs no controllers: the tests play the Job controller and the kubelet (a pod of the Job with the
`hpi profile` output as its termination message, the Job's status Complete or Failed) and check what the
operator does through the API, as on a cluster.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import kopf
import kubernetes
import pytest

from hpi_operator.autoscaling.decision import PodLoad
from hpi_operator.autoscaling.fleet_loop import fleet_poll
from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.nodes import node_info
from hpi_operator.op_metrics import OperatorMetrics
from hpi_operator.plan import make_plan
from hpi_testing.cluster_state import AsyncApi
from hpi_testing.kube_emulator import (
    L4,
    eventually,
    finished_job_pod,
    finished_job_status,
    make_node,
    operator_thread,
)

pytestmark = pytest.mark.slow

NS = "default"
CRS = f"/apis/serving.hpi.dev/v1alpha1/namespaces/{NS}/inferencedeployments"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
PODS = f"/api/v1/namespaces/{NS}/pods"
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CPU_FIGURES = {"itlAlphaMs": 40, "itlBetaMs": 2, "prefillTokensPerSecond": 900, "maxNumSeqs": 16}
# What `hpi profile --compact` prints on the L4 (the figures first, then the points and the machine).
PRINTED = {"itlAlphaMs": 9.5, "itlBetaMs": 0.25, "prefillTokensPerSecond": 5200.0, "maxNumSeqs": 120,
           "contextTokens": 1024, "decodePoints": [[1, 9.8], [4, 10.5], [16, 13.5], [64, 25.5]],
           "prefillPoints": [[512, 5200.0]], "device": "cuda", "dtype": "bfloat16"}  # fmt: skip


@pytest.fixture()
def operator(api: kubernetes.client.ApiClient) -> Iterator[Any]:
    """The operator with a 1 s backoff base after a failed profiling Job (300 s in production)."""
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    config = OperatorConfig(resync_interval_s=0.5, profile_retry_base_s=1.0)
    with operator_thread(build_registry(config), memo=memo):
        yield memo


def cr(name: str, pools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec = {"replicas": 1, "model": {"source": "huggingface", "huggingface": {"id": MODEL}},
            "slo": {"ttftP90": "1s", "itlP90": "100ms"},
            "autoscaling": {"enabled": True, "mode": "optimizer", "minReplicas": 1},
            "placement": {"pools": pools or [{"name": "gpu-l4", "costPerHour": 0.8}]}}  # fmt: skip
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}  # fmt: skip


def profile_jobs(kube: KubeClient, owner: str) -> dict[str, dict[str, Any]]:
    selector = f"app.kubernetes.io/component=pool-profile,app.kubernetes.io/instance={owner}"
    return {j["metadata"]["name"]: j for j in kube.request("GET", f"{JOBS}?labelSelector={selector}")["items"]}


def one_job(kube: KubeClient, owner: str) -> dict[str, Any] | None:
    found = profile_jobs(kube, owner)
    return next(iter(found.values())) if len(found) == 1 else None


def performance(kube: KubeClient, owner: str, pool: str) -> dict[str, Any]:
    body = kube.get(f"{CRS}/{owner}") or {}
    entry = next((p for p in (body.get("status") or {}).get("pools") or [] if p["name"] == pool), {})
    return entry.get("performance") or {}


def condition(kube: KubeClient, owner: str, type_: str) -> dict[str, Any]:
    body = kube.get(f"{CRS}/{owner}") or {}
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def events(kube: KubeClient, owner: str, reason: str) -> list[dict[str, Any]]:
    items = kube.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
    return [e for e in items if e["reason"] == reason and e["involvedObject"]["name"] == owner]


async def off(fn: Any, *args: Any) -> Any:
    """A call of the sync client off the loop that serves the emulator."""
    return await asyncio.to_thread(fn, *args)


async def run_job(api: AsyncApi, job: dict[str, Any], message: str | None, ok: bool = True) -> None:
    """Play the Job controller and the kubelet: the Job's pod ran `hpi profile` and left `message`, then the Job
    completed (or failed after its pod retries, its deadline)."""
    name = job["metadata"]["name"]
    if message is not None:
        pod, status = finished_job_pod(job, message, ok)
        await api.call("POST", PODS, pod)
        await api.patch(f"{PODS}/{pod['metadata']['name']}/status", status)
    reason = "" if ok else "Job was active longer than specified deadline"
    await api.patch(f"{JOBS}/{name}/status", finished_job_status(ok, reason))


async def test_a_pool_is_measured_once_cached_and_served_to_its_pods(kube: KubeClient, operator: Any) -> None:
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    await api.call("POST", "/api/v1/nodes", make_node("cpu-0", bf16=True))
    pools = [{"name": "gpu-l4", "costPerHour": 0.8},
             {"name": "cpu-amd64-bf16", "costPerHour": 0.3, "performance": CPU_FIGURES}]  # fmt: skip
    await api.call("POST", CRS, cr("first", pools))

    # One Job, for the pool without an override, on the pool's node kind, running `hpi profile` with its flags.
    job = await eventually(lambda: one_job(kube, "first"))
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.memory": "23034"}
    args = pod["containers"][0]["args"]
    assert args[0] == "profile" and "--compact" in args and args[args.index("--device") + 1] == "cuda"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    perf = await eventually(lambda: (p := performance(kube, "first", "gpu-l4")).get("job") and p)
    assert perf["source"] == "assumed" and perf["job"] == job["metadata"]["name"]  # serving meanwhile
    assert (await off(performance, kube, "first", "cpu-amd64-bf16"))["source"] == "override"
    assert (await off(condition, kube, "first", "PoolsProfiled"))["reason"] == "Measuring"
    assert list(await off(profile_jobs, kube, "first")) == [job["metadata"]["name"]]  # none for the overridden pool
    pool_cm = await eventually(lambda: kube.get(f"{CONFIGMAPS}/first-gpu-l4-profile"))
    assert json.loads(pool_cm["data"]["profile.json"])["source"] == "assumed"

    # The Job completes: measured figures in status, the cache written, the pool's ConfigMap updated, Job gone.
    await run_job(api, job, json.dumps(PRINTED, separators=(",", ":")))
    perf = await eventually(lambda: (p := performance(kube, "first", "gpu-l4")).get("source") == "measured" and p)
    assert (perf["itlAlphaMs"], perf["itlBetaMs"], perf["maxNumSeqs"]) == (9.5, 0.25, 120)
    assert perf["nodeKind"] == "gpu NVIDIA-L4 23034MiB" and perf["measuredAt"] and "job" not in perf
    cache = await off(kube.get, f"{CONFIGMAPS}/hpi-pool-profile-{perf['cacheKey']}")
    assert cache is not None and "ownerReferences" not in cache["metadata"]  # outlives this resource
    assert json.loads(cache["data"]["profile.json"])["itlAlphaMs"] == 9.5
    served = await eventually(lambda: json.loads(kube.get(f"{CONFIGMAPS}/first-gpu-l4-profile")["data"]
                                                 ["profile.json"] or "{}").get("source") == "measured")  # fmt: skip
    assert served
    await eventually(lambda: profile_jobs(kube, "first") == {})
    await eventually(lambda: condition(kube, "first", "PoolsProfiled").get("status") == "True")
    # kopf posts Events from a background queue: this one can land after the status that turns the condition True.
    await eventually(lambda: events(kube, "first", "PoolProfiled"))

    # The optimizer plans with the measured figures the status now holds.
    body = await off(kube.get, f"{CRS}/first")
    nodes = [node_info(make_node("gpu-l4-0", gpu=L4)), node_info(make_node("cpu-0", bf16=True))]
    plan = make_plan(body, nodes)
    loads = [PodLoad("p", 0.2, 0, 1, num_finished=0, prompt_tokens=0, generation_tokens=0)]
    first = fleet_poll(plan, loads, {}, dict(plan.replicas_by_pool), 1000.0)
    busy = [PodLoad("p", 0.2, 0, 1, num_finished=50, prompt_tokens=25_000, generation_tokens=10_000)]
    poll = fleet_poll(plan, busy, {"autoscaling": {"optimizer": first.status}}, dict(plan.replicas_by_pool), 1010.0)
    assert poll.status["pools"]["gpu-l4"]["source"] == "measured"
    assert poll.status["pools"]["cpu-amd64-bf16"]["source"] == "override"
    assert "(measured figures)" in poll.message, poll.message  # the explanation says what the choice rests on

    # A second resource of the same model on the same node kind reuses the cache: measured, without a Job.
    await api.call("POST", CRS, cr("second", pools))
    perf2 = await eventually(lambda: (p := performance(kube, "second", "gpu-l4")).get("source") == "measured" and p)
    assert perf2["cacheKey"] == perf["cacheKey"] and perf2["itlAlphaMs"] == 9.5
    assert await off(profile_jobs, kube, "second") == {}  # never created (nothing completes them)


async def test_failed_and_unreadable_measurements_are_reported_and_retried(kube: KubeClient, operator: Any) -> None:
    api = AsyncApi(kube)
    await api.call("POST", "/api/v1/nodes", make_node("gpu-l4-0", gpu=L4))
    await api.call("POST", CRS, cr("flaky"))
    first = await eventually(lambda: one_job(kube, "flaky"))

    # The Job fails (its deadline): a condition and one Event; the pool serves meanwhile; attempt 2 after 1 s.
    await run_job(api, first, None, ok=False)
    [event] = await eventually(lambda: events(kube, "flaky", "ProfilingFailed"))
    assert event["type"] == "Warning" and "attempt 1 failed" in event["message"] and "deadline" in event["message"]
    cond = await eventually(lambda: (c := condition(kube, "flaky", "PoolsProfiled")).get("reason")
                            == "ProfilingFailed" and c)  # fmt: skip
    assert cond["status"] == "False" and "serve meanwhile" in cond["message"]
    second = await eventually(lambda: (j := one_job(kube, "flaky")) and j["metadata"]["uid"] != first["metadata"]["uid"]
                              and j)  # fmt: skip
    assert second["metadata"]["annotations"]["serving.hpi.dev/profile-attempt"] == "2"
    assert (await off(performance, kube, "flaky", "gpu-l4"))["source"] == "assumed"

    # Attempt 2 completes with a message that is no profile (a crash's traceback): a clear condition, no crash.
    await run_job(api, second, "Traceback (most recent call last):\n  torch.OutOfMemoryError: CUDA out of memory")
    [unreadable] = await eventually(lambda: events(kube, "flaky", "UnreadableProfile"))
    assert "attempt 2 completed but left no readable profile" in unreadable["message"]
    assert "not JSON" in unreadable["message"]
    perf = await eventually(lambda: (p := performance(kube, "flaky", "gpu-l4")).get("attempt") == 3 and p)
    assert "left no readable profile" in perf["lastFailure"] and perf["source"] == "assumed"
    assert await off(kube.get, f"{CONFIGMAPS}/hpi-pool-profile-{perf['cacheKey']}") is None  # nothing cached
    third = await eventually(lambda: one_job(kube, "flaky"))
    await run_job(api, third, json.dumps(PRINTED))
    await eventually(lambda: performance(kube, "flaky", "gpu-l4").get("source") == "measured")
    assert "lastFailure" not in await off(performance, kube, "flaky", "gpu-l4")
    assert (await off(condition, kube, "flaky", "PoolsProfiled"))["status"] == "True"
