"""Status and conditions, and the reconcile outcome for bad specs (pure parts)."""

from __future__ import annotations

from typing import Any

from hpi_operator.nodes import node_info
from hpi_operator.plan import make_plan
from hpi_operator.reconcile import reconcile
from hpi_operator.status import ChildState, build_status, failed_status, merge_conditions, status_changes
from hpi_operator.wakeups import owner_uids
from hpi_testing.kube_emulator import L4, make_node

NODES = [node_info(make_node("g", gpu=L4)), node_info(make_node("c", bf16=True))]
BODY = {
    "apiVersion": "serving.hpi.dev/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "demo", "namespace": "default", "uid": "u", "generation": 2},
    "spec": {"replicas": 2},
}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def states(plan: Any, ready: int) -> dict[str, ChildState]:
    result = {}
    for dep in plan.deployments:
        want = dep["spec"]["replicas"]
        got = min(want, ready)
        ready -= got
        result[dep["metadata"]["name"]] = ChildState(dep["metadata"]["name"], want, want, got, want, True)
    return result


def test_rolling_out_then_ready() -> None:
    plan = make_plan(BODY, NODES)
    rolling = build_status(plan, states(plan, 0), 2, {}, "t0")
    assert conditions(rolling) == {
        "Ready": ("False", "ReplicasNotReady"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }
    assert rolling["observedGeneration"] == 2 and rolling["selector"] == plan.selector
    done = build_status(plan, states(plan, 2), 2, rolling, "t1")
    assert conditions(done)["Ready"] == ("True", "AllReplicasReady")
    assert conditions(done)["Progressing"] == ("False", "RolloutComplete")
    assert done["readyReplicas"] == 2 and done["replicas"] == 2
    times = {c["type"]: c["lastTransitionTime"] for c in done["conditions"]}
    assert times == {"Ready": "t1", "Progressing": "t1", "Degraded": "t0"}  # only flips move the time


def test_pools_report_profile_and_reason() -> None:
    plan = make_plan(BODY, NODES)
    status = build_status(plan, states(plan, 1), 2, {}, "t")
    by_name = {p["name"]: p for p in status["pools"]}
    assert by_name["gpu-l4"]["profile"] == "cuda:bf16" and by_name["gpu-l4"]["replicas"] == 1
    assert by_name["gpu-l4"]["accelerator"] == "NVIDIA-L4"
    assert "weights" in by_name["cpu-amd64-bf16"]["reason"]
    assert status["profile"] == "1xcuda:bf16 1xcpu:bf16"


def test_scale_to_zero_is_ready() -> None:
    body = {**BODY, "spec": {"replicas": 0}}
    plan = make_plan(body, NODES)
    assert conditions(build_status(plan, states(plan, 0), 2, {}, "t"))["Ready"] == ("True", "ScaledToZero")


def test_pods_put_to_sleep_are_ready_by_design_not_a_rollout() -> None:
    plan = make_plan(BODY, NODES)
    slept = {"autoscaling": {"sleep": {"level": 2, "pods": ["demo-gpu-l4-x", "demo-cpu-y"], "sinceEpoch": 1}}}
    status = build_status(plan, states(plan, 0), 2, slept, "t")
    assert conditions(status)["Ready"] == ("True", "Sleeping") and conditions(status)["Progressing"][0] == "False"
    assert status["readyReplicas"] == 0  # they are not ready: the Services send them nothing
    one_asleep = {"autoscaling": {"sleep": {"level": 2, "pods": ["demo-cpu-y"], "sinceEpoch": 1}}}
    assert conditions(build_status(plan, states(plan, 0), 2, one_asleep, "t"))["Ready"] == ("False", "ReplicasNotReady")


def test_capacity_shortfall_is_degraded() -> None:
    plan = make_plan({**BODY, "spec": {"replicas": 50, "placement": {"profile": {"device": "cuda"}}}}, NODES)
    assert plan.num_unplaced == 49
    assert conditions(build_status(plan, {}, 2, {}, "t"))["Degraded"] == ("True", "InsufficientCapacity")


def test_failed_status_keeps_ready_and_sets_degraded() -> None:
    old = {"conditions": merge_conditions([], [{"type": "Ready", "status": "True", "reason": "AllReplicasReady",
                                                "message": "2/2"}], "t0")}  # fmt: skip
    status = failed_status(3, old, "t1", "InvalidSpec", "bad")
    assert conditions(status) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    assert status["observedGeneration"] == 3


def test_invalid_spec_outcome_is_permanent_with_an_event_and_no_api_calls() -> None:
    body = {**BODY, "spec": {"model": {"source": "pvc"}}}
    outcome = reconcile(body, NODES, kube=None, now="t")  # type: ignore[arg-type]  # never reached
    assert type(outcome.error).__name__ == "PermanentError"
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "InvalidSpec")]
    assert conditions(outcome.status)["Degraded"] == ("True", "InvalidSpec")


def test_unplaceable_outcome_lists_every_pool_reason() -> None:
    body = {**BODY, "spec": {"placement": {"profile": {"dtype": "fp16", "device": "cpu"}}}}
    outcome = reconcile({**BODY, "spec": {"model": {"source": "huggingface", "huggingface": {
        "id": "meta-llama/Llama-3.1-70B-Instruct"}}, "placement": {"profile": {"quantization": "none"}}}},
        NODES, kube=None, now="t")  # type: ignore[arg-type]  # fmt: skip
    assert outcome.result == "unplaceable"
    message = conditions(outcome.status)["Degraded"]
    assert message == ("True", "NoFittingPool")
    degraded = next(c for c in outcome.status["conditions"] if c["type"] == "Degraded")
    assert "gpu-l4" in degraded["message"] and "cpu-amd64-bf16" in degraded["message"]
    assert {p["name"] for p in outcome.status["pools"]} == {"gpu-l4", "cpu-amd64-bf16"}
    assert reconcile(body, NODES, kube=None, now="t").result == "invalid"  # type: ignore[arg-type]
    no_nodes = reconcile(BODY, [], kube=None, now="t")  # type: ignore[arg-type]
    assert no_nodes.result == "unplaceable" and "no usable nodes" in no_nodes.events[0].message


def test_status_changes_are_only_what_moved() -> None:
    """A pass writes status only when it says something new: nulls equal missing keys, and a condition whose
    lastTransitionTime alone differs is the same condition."""
    old = {"replicas": 2, "modelCache": {"servedPath": "/p", "previousPath": None},
           "conditions": [{"type": "Ready", "status": "True", "reason": "R", "lastTransitionTime": "t0"}]}  # fmt: skip
    same = {"replicas": 2, "modelCache": {"servedPath": "/p"}, "kvCacheUtilization": None,
            "conditions": [{"type": "Ready", "status": "True", "reason": "R", "lastTransitionTime": "t1"}]}  # fmt: skip
    assert status_changes(old, same) == {}
    moved = {**same, "replicas": 3, "conditions": [{"type": "Ready", "status": "False", "reason": "R"}]}
    assert status_changes(old, moved) == {"replicas": 3, "conditions": moved["conditions"]}


def test_child_events_wake_only_the_inference_deployments_that_own_them() -> None:
    refs = [{"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment", "uid": "a"},
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "uid": "b"},
            {"apiVersion": "other.io/v1", "kind": "InferenceDeployment", "uid": "c"}]  # fmt: skip
    assert owner_uids({"ownerReferences": refs}) == ["a"]
    assert owner_uids({}) == []


def test_status_reports_total_and_active_parameters_of_a_mixture_of_experts() -> None:
    dense = make_plan(BODY, NODES)
    status = build_status(dense, states(dense, 2), 2, {}, "t")
    assert status["modelParameters"]["total"] == status["modelParameters"]["active"] > 100_000_000
    mixtral = {**BODY, "spec": {"replicas": 1, "model": {"source": "huggingface",
               "huggingface": {"id": "mistralai/Mixtral-8x7B-Instruct-v0.1"}}}}  # fmt: skip
    plan = make_plan(mixtral, [node_info(make_node("g", gpu=("NVIDIA-H200", 143771, 8), memory="1Ti"))])
    params = build_status(plan, states(plan, 1), 2, {}, "t")["modelParameters"]
    assert params == {"total": 46_702_792_704, "active": 12_879_925_248}
