"""Pool profiling as pure functions: the cache key, the profiling Job (the pool's own pod running `hpi profile`),
the ConfigMaps, reading a Job's termination message, and which figures a pool runs on (override > measured >
assumed) in the plan and the optimizer's offers."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from hpi_contracts.pool_profile import PoolProfile
from hpi_operator import profiling
from hpi_operator.fleet.offers import pool_offers
from hpi_operator.fleet.performance import Demand, PoolPerformance
from hpi_operator.nodes import group_pools, node_info
from hpi_operator.plan import make_plan
from hpi_operator.profiling import CachedProfile as Cached
from hpi_operator.profiling import (
    build_cache_configmap,
    cache_key,
    measured_from_status,
    node_kind,
    profile_from_message,
    read_cache_configmap,
    termination_message,
)
from hpi_testing.kube_emulator import L4, make_node

NODES = [node_info(make_node("l4-0", gpu=L4)), node_info(make_node("cpu-0", bf16=True, labels={
    "node.kubernetes.io/instance-type": "m7i.8xlarge"}))]  # fmt: skip
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SLO = {"ttftP90": "1s", "itlP90": "100ms"}
MEASURED = PoolProfile(12.0, 0.5, 3000.0, 40, "measured")


def cr(**spec: Any) -> dict[str, Any]:
    base = {"replicas": 1, "model": {"source": "huggingface", "huggingface": {"id": MODEL, "revision": "r1"}},
            "slo": SLO, "autoscaling": {"enabled": True, "mode": "optimizer", "minReplicas": 1}}  # fmt: skip
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1"}, "spec": {**base, **spec}}  # fmt: skip


def pools_of(plan: Any) -> dict[str, Any]:
    return {c.pool.name: c for c in plan.choices}


def test_the_cache_key_changes_with_model_engine_and_node_kind_only() -> None:
    plan = make_plan(cr(), NODES)
    gpu = pools_of(plan)["gpu-l4"]
    key = cache_key(plan.spec, gpu.profile, gpu.pool)
    again = make_plan(cr(replicas=3), NODES)  # replicas and the resource's name are not what speed depends on
    assert cache_key(again.spec, gpu.profile, gpu.pool) == key
    for change in ({"model": {"source": "huggingface", "huggingface": {"id": MODEL, "revision": "r2"}}},
                   {"engine": {"maxNumSeqs": 32}}, {"placement": {"profile": {"quantization": "int8"}}}):  # fmt: skip
        other = make_plan(cr(**change), NODES)
        choice = pools_of(other)["gpu-l4"]
        assert cache_key(other.spec, choice.profile, choice.pool) != key, change
    bigger = [node_info(make_node("l4-0", gpu=("NVIDIA-L4", 46068, 1)))]
    [pool] = group_pools(bigger)
    assert node_kind(pool) == "gpu NVIDIA-L4 46068MiB" and cache_key(plan.spec, gpu.profile, pool) != key
    cpu = pools_of(plan)["cpu-amd64-bf16"].pool
    assert node_kind(cpu) == "cpu amd64 amx m7i.8xlarge"
    # The measurement's method is part of the key: figures from before decode was timed at the serving context
    # (or at another context) are not reused.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiling, "CONTEXT_TOKENS", 2048)
        assert cache_key(plan.spec, gpu.profile, gpu.pool) != key


def test_the_profiling_job_is_the_pools_pod_running_hpi_profile() -> None:
    from hpi_runtime.cli import build_parser  # the test environment has every component installed

    plan = make_plan(cr(), NODES)
    target = next(t for t in plan.profile_targets if t.pool == "gpu-l4")
    job, deployment = target.job, next(d for d in plan.deployments if d["metadata"]["name"] == "demo-gpu-l4")
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
    pod, served = job["spec"]["template"]["spec"], deployment["spec"]["template"]["spec"]
    [container], [runtime] = pod["containers"], served["containers"]
    assert job["spec"]["backoffLimit"] == 1 and job["spec"]["activeDeadlineSeconds"] <= 1800
    assert pod["restartPolicy"] == "Never" and job["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # On the pool's node kind, with the pool's image, resources and model volume.
    for key in ("nodeSelector", "tolerations", "affinity", "initContainers"):
        assert pod.get(key) == served.get(key), key
    assert pod["volumes"] == [v for v in served["volumes"] if v["name"] != "pool-profile"]  # it measures, reads none
    assert container["image"] == runtime["image"] and container["resources"] == runtime["resources"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "readinessProbe" not in container and container["terminationMessagePath"] == "/dev/termination-log"
    # Not selected as a runtime pod by the Services, the PDB or the autoscaler.
    assert "serving.hpi.dev/inference-deployment" not in job["spec"]["template"]["metadata"]["labels"]
    # Exactly the pool's engine flags, as `hpi profile` parses them, plus a short measurement.
    args, unknown = build_parser().parse_known_args(container["args"])
    assert unknown == [] and args.command == "profile" and args.compact and args.output == "/dev/termination-log"
    serve, _ = build_parser().parse_known_args(runtime["args"])
    for flag in ("model", "dtype", "device", "quantization", "kv_cache_memory_bytes", "max_num_seqs", "block_size",
                 "kv_cache_dtype", "max_model_len", "tensor_parallel_size"):  # fmt: skip
        assert getattr(args, flag) == getattr(serve, flag), flag
    assert max(args.batch_sizes) <= args.max_num_seqs and args.steps <= 8
    assert target.key in job["metadata"]["name"] or target.key[:8] in job["metadata"]["name"]


def test_pools_serve_their_profile_configmap_through_a_mounted_file() -> None:
    plan = make_plan(cr(), NODES)
    deployment = next(d for d in plan.deployments if d["metadata"]["name"] == "demo-gpu-l4")
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--pool-profile") + 1] == "@/etc/hpi/pool-profile/profile.json"
    assert {"name": "pool-profile", "configMap": {"name": "demo-gpu-l4-profile", "optional": True}} in pod["volumes"]
    for child in (*plan.deployments, *plan.profile_configmaps):  # the mounted volume, the ConfigMaps: valid
        kubernetes_validate.validate(child, kubernetes_validate.latest_version(), strict=True)
    configmaps = {c["metadata"]["name"]: c for c in plan.profile_configmaps}
    assert set(configmaps) == {"demo-gpu-l4-profile", "demo-cpu-amd64-bf16-profile"}
    assert all(c in plan.children for c in configmaps.values())
    gpu = json.loads(configmaps["demo-gpu-l4-profile"]["data"]["profile.json"])
    assert gpu["source"] == "assumed"  # the L4's published figures until measured
    assert configmaps["demo-cpu-amd64-bf16-profile"]["data"]["profile.json"] == ""  # a CPU has none: no gauges
    never = make_plan(cr(placement={"profiling": "never"}), NODES)
    assert not never.profile_targets and not never.profile_configmaps
    assert "--pool-profile" not in never.deployments[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    kv_mode = make_plan(cr(autoscaling={"enabled": True, "mode": "builtin"}), NODES)  # auto: only the optimizer's
    assert not kv_mode.profile_targets and not kv_mode.figures


def test_figures_are_the_override_else_measured_else_assumed() -> None:
    override = {"itlAlphaMs": 30, "itlBetaMs": 1, "prefillTokensPerSecond": 800, "maxNumSeqs": 16}
    body = cr(placement={"pools": [{"name": "cpu-amd64-bf16", "costPerHour": 0.5, "performance": override},
                                   {"name": "gpu-l4", "costPerHour": 0.8}]})  # fmt: skip
    plan = make_plan(body, NODES)
    assert [t.pool for t in plan.profile_targets] == ["gpu-l4"]  # the override needs no Job
    assert plan.figures["cpu-amd64-bf16"].source == "override" and plan.figures["gpu-l4"].source == "assumed"
    measured = make_plan(body, NODES, measured={"gpu-l4": MEASURED})
    assert measured.figures["gpu-l4"] == MEASURED
    serving = [c for c in measured.choices if c.profile is not None]
    offers = pool_offers(measured.spec, serving, measured.shape, Demand(1.0, 100, 100),
                         measured={"gpu-l4": PoolPerformance.from_profile(MEASURED)})  # fmt: skip
    by_pool = {o.name: o.performance for o in offers.offers}
    assert by_pool["gpu-l4"].source == "measured" and by_pool["gpu-l4"].itl_alpha_s == pytest.approx(0.012)
    assert by_pool["cpu-amd64-bf16"].source == "override"


def test_measured_figures_in_status_count_only_for_the_current_key() -> None:
    plan = make_plan(cr(), NODES)
    key = next(t.key for t in plan.profile_targets if t.pool == "gpu-l4")
    entry = {"name": "gpu-l4", "performance": {**json.loads(json.dumps(MEASURED.as_json())), "cacheKey": key}}
    assert measured_from_status({"pools": [entry]}, {"gpu-l4": key}) == {"gpu-l4": MEASURED}
    assert measured_from_status({"pools": [entry]}, {"gpu-l4": "another"}) == {}
    assert make_plan({**cr(), "status": {"pools": [entry]}}, NODES).figures["gpu-l4"] == MEASURED


def test_the_termination_message_parses_as_measured_or_says_why_not() -> None:
    printed = {"itlAlphaMs": 11.5, "itlBetaMs": 0.4, "prefillTokensPerSecond": 2500.0, "maxNumSeqs": 30,
               "contextTokens": 1024, "decodePoints": [[1, 11.9]], "device": "cuda", "dtype": "bfloat16"}  # fmt: skip
    pod = {"status": {"containerStatuses": [{"name": "profile", "state": {"terminated": {
        "exitCode": 0, "message": json.dumps(printed, separators=(",", ":"))}}}]}}  # fmt: skip
    assert profile_from_message(termination_message(pod)) == PoolProfile(11.5, 0.4, 2500.0, 30, "measured")
    with pytest.raises(ValueError, match="not JSON"):
        profile_from_message("Traceback (most recent call last): CUDA out of memory")
    with pytest.raises(ValueError, match="needs maxNumSeqs"):
        profile_from_message('{"itlAlphaMs": 1, "itlBetaMs": 0, "prefillTokensPerSecond": 9}')
    with pytest.raises(ValueError, match="no termination message"):
        profile_from_message(termination_message({"status": {}}))


def test_a_cache_entry_round_trips_and_a_broken_one_is_refused() -> None:
    entry = build_cache_configmap("ml", "abc", Cached(MEASURED, "2026-12-01T00:00:00Z", "gpu NVIDIA-L4 23034MiB"),
                                  "hf:org/m@r1")  # fmt: skip
    assert entry["metadata"]["name"] == "hpi-pool-profile-abc" and "ownerReferences" not in entry["metadata"]
    kubernetes_validate.validate(entry, kubernetes_validate.latest_version(), strict=True)
    back = read_cache_configmap(entry)
    assert (back.profile, back.measured_at, back.node_kind) == (MEASURED, "2026-12-01T00:00:00Z",
                                                                "gpu NVIDIA-L4 23034MiB")  # fmt: skip
    with pytest.raises(ValueError, match="not JSON"):
        read_cache_configmap({"metadata": {"name": "x"}, "data": {"profile.json": "{"}})
