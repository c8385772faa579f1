"""The model cache's pure half (cache.py) and its plan: claim size, Jobs, pod wiring, Job states, status."""

from __future__ import annotations

from typing import Any

import pytest

from hpi_operator.cache import JobState, cache_size_gib, retry_delay_s
from hpi_operator.cache_sync import CacheReport, cache_status
from hpi_operator.nodes import node_info
from hpi_operator.plan import Plan, make_plan
from hpi_operator.sizing import KNOWN_SHAPES
from hpi_operator.spec import SpecError
from hpi_testing.kube_emulator import L4, make_node

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def plan(cache: dict[str, Any], status: dict[str, Any] | None = None, **hf: Any) -> Plan:
    body = {
        "metadata": {"name": "llama", "namespace": "team-a", "uid": "u-1"},
        "spec": {"model": {"source": "huggingface", "huggingface": {"id": LLAMA, **hf}, "cache": cache}},
        "status": status or {},
    }
    return make_plan(body, [node_info(make_node("gpu-0", gpu=L4))])


def test_claim_holds_two_revisions_of_the_checkpoint() -> None:
    # Llama 3.1 8B: 16.1 GB of bf16 shards, twice (serving + next revision), plus 10%.
    assert cache_size_gib(KNOWN_SHAPES["llama-3.1-8b-instruct"]) == 33
    p = plan({"enabled": True})
    assert p.cache is not None and p.cache.pvc is not None and p.cache.owns_claim
    assert p.cache.pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "33Gi"}}}
    assert p.cache.pvc["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    explicit = plan({"enabled": True, "size": "100Gi", "accessMode": "ReadWriteOnce", "storageClassName": "fast"})
    assert explicit.cache is not None and explicit.cache.pvc is not None
    assert explicit.cache.pvc["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert explicit.cache.pvc["spec"]["storageClassName"] == "fast"


def test_waiting_plan_has_no_pods_and_a_cached_one_mounts_read_only() -> None:
    waiting = plan({"enabled": True}, revision="abc123")
    assert waiting.placeable and waiting.waiting_for_cache and waiting.deployments == ()
    assert waiting.cache is not None
    job = waiting.cache.fill_job
    assert job["spec"]["backoffLimit"] >= 1 and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:5] == ["fetch", LLAMA, f"/model-cache/models/{LLAMA}/abc123", "--revision", "abc123"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    served = plan({"enabled": True}, {"modelCache": {"servedPath": f"/model-cache/models/{LLAMA}/abc123"}},
                  revision="abc123")  # fmt: skip
    [deployment] = served.deployments
    pod = deployment["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["check-model-cache"]
    assert all(m.get("readOnly") for c in pod["initContainers"] for m in c["volumeMounts"]
               if m["name"] == "model-cache")  # fmt: skip
    # The fingerprint moves when the cache does: the resync re-reconciles when a download completes.
    assert served.fingerprint != waiting.fingerprint


def test_existing_claim_is_used_not_created() -> None:
    p = plan({"enabled": True, "claimName": "shared-models"}, {"modelCache": {"servedPath": "/model-cache/x"}})
    assert p.cache is not None and p.cache.pvc is None and not p.cache.owns_claim
    assert not any(c["kind"] == "PersistentVolumeClaim" for c in p.children)
    volumes = p.deployments[0]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "shared-models"}} in volumes


@pytest.mark.parametrize("cache", [{"enabled": True}, {"enabled": True, "volume": "hostPath"}])
def test_compile_cache_is_the_cache_volumes_one_writable_directory(cache: dict[str, Any]) -> None:
    p = plan(cache, {"modelCache": {"servedPath": "/model-cache/x"}})
    pod = p.deployments[0]["spec"]["template"]["spec"]
    [main] = pod["containers"]
    assert main["args"][main["args"].index("--compile-cache-dir") + 1] == "/compile-cache"
    cache_mounts = [m for m in main["volumeMounts"] if m["name"] == "model-cache"]
    assert cache_mounts == [{"name": "model-cache", "mountPath": "/model-cache", "readOnly": True},
                            {"name": "model-cache", "mountPath": "/compile-cache", "subPath": "compile-cache"}]
    # Neither init container gets the compile cache: they compile nothing.
    assert all(m["mountPath"] != "/compile-cache" for c in pod["initContainers"] for m in c["volumeMounts"])
    without = plan({"enabled": False})
    assert "--compile-cache-dir" not in without.deployments[0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_node_local_cache_fills_on_each_node_without_a_job() -> None:
    p = plan({"enabled": True, "volume": "hostPath", "hostPath": "/mnt/models"})
    assert p.cache is None and not p.waiting_for_cache
    pod = p.deployments[0]["spec"]["template"]["spec"]
    assert {"name": "model-cache", "hostPath": {"path": "/mnt/models", "type": "DirectoryOrCreate"}} in pod["volumes"]
    [fetch] = pod["initContainers"]
    assert fetch["args"][:3] == ["fetch", LLAMA, f"/model-cache/models/{LLAMA}/main"]
    assert {"name": "model-cache", "mountPath": "/model-cache"} in fetch["volumeMounts"]  # writable here only
    main = pod["containers"][0]
    assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in main["volumeMounts"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"source": "embedded", "cache": {"enabled": True}}, "is for source huggingface"),
        ({"cache": {"enabled": True, "volume": "hostPath", "claimName": "x"}}, "are for volume persistentVolumeClaim"),
        ({"cache": {"enabled": True, "size": "-3Gi"}}, "positive quantity"),
        ({"huggingface": {"id": LLAMA, "revision": "../etc"}}, "branch, tag or commit"),
    ],
)
def test_bad_cache_specs_are_spec_errors(model: dict[str, Any], message: str) -> None:
    spec = {"model": {"source": "huggingface", "huggingface": {"id": LLAMA}, **model}}
    with pytest.raises(SpecError, match=message):
        make_plan({"metadata": {"name": "x"}, "spec": spec}, [node_info(make_node("gpu-0", gpu=L4))])


def test_job_states_and_backoff() -> None:
    failed = {"metadata": {"name": "j", "annotations": {"serving.hpi.dev/cache-attempt": "3"}},
              "status": {"failed": 4, "conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
                                                      "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}  # fmt: skip
    state = JobState.from_job(failed)
    assert (state.phase, state.attempt, state.num_failed_pods) == ("Failed", 3, 4)
    assert state.finished_at == "2026-01-01T00:00:00Z" and state.message == "DeadlineExceeded"
    assert JobState.from_job({"metadata": {"name": "j"}, "status": {"active": 1}}).phase == "Running"
    assert JobState.from_job({"metadata": {"name": "j"}, "status": {"succeeded": 1}}).phase == "Complete"
    assert [retry_delay_s(a, 60) for a in (1, 2, 3, 8)] == [60, 120, 240, 3600]

    p = plan({"enabled": True})
    entry, cond = cache_status(p, CacheReport(state, None, None, "2026-01-01T00:04:00Z", "Job j attempt 3 failed: x"))
    assert cond["type"] == "ModelCached" and cond["status"] == "False" and cond["reason"] == "DownloadFailed"
    assert "attempt 4 starts at 2026-01-01T00:04:00Z" in cond["message"]
    assert entry["phase"] == "Failed" and entry["nextAttemptAt"] == "2026-01-01T00:04:00Z"
