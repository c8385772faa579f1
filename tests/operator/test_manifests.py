"""Child manifests: valid Kubernetes objects (kubernetes-validate --strict), the runtime's contract, safety."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from hpi_contracts.serve import serve_args
from hpi_contracts.serve_flags import SERVE_FLAGS
from hpi_operator.manifests import short_name, spec_hash
from hpi_operator.names import ANNOTATION_SPEC_HASH
from hpi_operator.nodes import node_info
from hpi_operator.plan import Plan, make_plan
from hpi_operator.sizing import kv_bytes_per_token as replica_kv_bytes_per_token
from hpi_operator.sizing import model_shape
from hpi_testing.kube_emulator import H100, L4, T4, make_node

K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
NODES = [node_info(n) for n in (make_node("h", gpu=H100), make_node("l", gpu=L4), make_node("t", gpu=T4),
                                make_node("c", bf16=True), make_node("o"))]  # fmt: skip


def cr(spec: dict[str, Any] | None = None, name: str = "demo", uid: str | None = "uid-1") -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "ml", "labels": {"team": "search"}, "generation": 3}
    if uid:
        metadata["uid"] = uid
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": metadata,
            "spec": spec or {}}  # fmt: skip


SPECS = {
    "embedded": {"replicas": 2},
    "pvc-8b": {
        "replicas": 4,
        "model": {
            "source": "pvc",
            "pvc": {"claimName": "weights", "path": "llama/8b"},
            "size": {"parameters": "8B", "numLayers": 32, "numKVHeads": 8, "headDim": 128},
        },
        "apiKeySecretRef": {"name": "api"},
        "resources": {"requests": {"cpu": "3"}},
        "runtime": {"imagePullSecrets": [{"name": "regcred"}], "env": [{"name": "LOG", "value": "1"}]},
    },
    "hf-70b": {
        "replicas": 2,
        "model": {
            "source": "huggingface",
            "huggingface": {"id": "meta-llama/Llama-3.1-70B-Instruct", "tokenSecretRef": {"name": "hf"}},
        },
        # One GPU per replica: quantize rather than split (the int4 path; splitting is tested below).
        "placement": {"tolerations": [{"key": "spot", "operator": "Exists"}], "maxGpusPerReplica": 1},
        "engine": {"maxNumBatchedTokens": 4096},
    },
    "pvc-lora": {  # LoRA adapters on a volume the pods mount (tests/operator/test_adapters.py: the rest)
        "model": {"source": "pvc", "pvc": {"claimName": "weights"},
                  "size": {"parameters": "1B", "numLayers": 16, "numKVHeads": 8, "headDim": 64}},
        "adapters": [{"name": "sql", "source": {"path": "adapters/sql"}}],
        "engine": {"maxLoras": 2},
    },
}


def plan_for(key: str, **kwargs: Any) -> Plan:
    return make_plan(cr(copy.deepcopy(SPECS[key]), **kwargs), NODES)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("key", sorted(SPECS))
def test_every_child_passes_kubernetes_validate_strict(key: str, version: str) -> None:
    plan = plan_for(key)
    assert plan.placeable
    for child in plan.children:
        kubernetes_validate.validate(child, version, strict=True)


def service_mode(key: str) -> Plan:
    """A spec of SPECS with spec.routing.mode service: the children as they were before routing modes."""
    return make_plan(cr({**copy.deepcopy(SPECS[key]), "routing": {"mode": "service"}}), NODES)


def test_one_deployment_per_serving_pool_plus_service_and_pdb() -> None:
    plan = service_mode("embedded")
    kinds = [c["kind"] for c in plan.children]
    assert kinds.count("Deployment") == len(plan.choices) == 5
    assert kinds[-2:] == ["Service", "PodDisruptionBudget"]
    assert sum(d["spec"]["replicas"] for d in plan.deployments) == 2


def test_owner_references_namespace_and_inherited_labels() -> None:
    for child in plan_for("embedded").children:
        [ref] = child["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment", "name": "demo",
            "uid": "uid-1", "controller": True, "blockOwnerDeletion": True,
        }  # fmt: skip
        assert child["metadata"]["namespace"] == "ml"
        assert child["metadata"]["labels"]["team"] == "search"
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "hpi-operator"


def test_offline_render_without_uid_has_no_owner_references() -> None:
    plan = make_plan(cr(SPECS["embedded"], uid=None), NODES)
    assert all("ownerReferences" not in c["metadata"] for c in plan.children)


def deployment(plan: Plan, pool: str) -> dict[str, Any]:
    return next(d for d in plan.deployments if d["metadata"]["labels"]["serving.hpi.dev/pool"] == pool)


def container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_gpu_deployment_shape() -> None:
    dep = deployment(plan_for("pvc-8b"), "gpu-h100-80gb-hbm3")
    pod = dep["spec"]["template"]["spec"]
    main = container(dep)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert main["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert main["resources"]["requests"]["cpu"] == "3"  # the user's request wins
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    env = {e["name"]: e for e in main["env"]}
    assert env["HPI_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "api", "key": "api-key"}
    assert env["LOG"]["value"] == "1"


def test_probes_drain_and_scrape_annotations() -> None:
    dep = deployment(plan_for("embedded"), "cpu-amd64-bf16")
    pod = dep["spec"]["template"]["spec"]
    main = container(dep)
    assert main["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert main["startupProbe"]["httpGet"]["path"] == "/health"
    assert main["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    drain = int(main["args"][main["args"].index("--drain-timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] > drain + int(main["lifecycle"]["preStop"]["exec"]["command"][1])
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8000"
    assert main["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_secure_by_default() -> None:
    for dep in plan_for("hf-70b").deployments:
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_cpu_pods_request_the_memory_their_profile_needs() -> None:
    plan = plan_for("embedded")
    dep = deployment(plan, "cpu-amd64")
    profile = plan.choice("cpu-amd64").profile
    assert profile is not None
    resources = container(dep)["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert int(resources["requests"]["memory"].removesuffix("Mi")) * 2**20 >= profile.needed_bytes
    assert "nvidia.com/gpu" not in resources["limits"]
    affinity = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.product", "operator": "DoesNotExist"} in terms[0]["matchExpressions"]


def test_huggingface_model_is_fetched_by_an_init_container_into_the_cache() -> None:
    dep = deployment(plan_for("hf-70b"), "gpu-h100-80gb-hbm3")
    pod = dep["spec"]["template"]["spec"]
    [fetch] = pod["initContainers"]
    model_id = "meta-llama/Llama-3.1-70B-Instruct"
    assert fetch["command"] == ["python", "-m", "hpi_runtime.download"]
    assert fetch["args"] == ["fetch", model_id, f"/cache/models/{model_id}", "--revision", "main"]
    args = container(dep)["args"]
    assert args[args.index("--model") + 1] == "/cache/models/meta-llama/Llama-3.1-70B-Instruct"
    env = {e["name"]: e for e in fetch["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    assert {"key": "spot", "operator": "Exists"} in pod["tolerations"]


def test_runtime_args_match_the_profile() -> None:
    plan = plan_for("hf-70b")
    assert "gpu-t4" not in plan.replicas_by_pool  # 70B fits no T4: no Deployment there
    h100 = container(deployment(plan, "gpu-h100-80gb-hbm3"))["args"]

    def arg(args: list[str], flag: str) -> str:
        return args[args.index(flag) + 1]

    assert (arg(h100, "--dtype"), arg(h100, "--quantization"), arg(h100, "--device")) == ("bfloat16", "int4", "cuda")
    assert arg(h100, "--served-model-name") == "meta-llama/Llama-3.1-70B-Instruct"
    assert arg(h100, "--max-num-batched-tokens") == "4096"
    assert int(arg(h100, "--kv-cache-memory")) == plan.choice("gpu-h100-80gb-hbm3").profile.kv_cache_bytes  # type: ignore[union-attr]
    assert arg(h100, "--port") == "8000" and arg(h100, "--host") == "0.0.0.0"
    # A pre-quantized checkpoint: the runtime detects its format, so no --quantization flag (it would be refused).
    awq = {"replicas": 1, "model": {"source": "huggingface",
                                    "huggingface": {"id": "hugging-quants/Llama-3.1-70B-Instruct-AWQ"}}}  # fmt: skip
    awq_plan = make_plan(cr(awq), NODES)
    awq_args = container(deployment(awq_plan, "gpu-h100-80gb-hbm3"))["args"]
    assert "--quantization" not in awq_args and awq_plan.choice("gpu-h100-80gb-hbm3").profile.quantization == "int4"  # type: ignore[union-attr]
    embedded = container(deployment(plan_for("embedded"), "cpu-amd64"))["args"]
    assert "--model" not in embedded  # the runtime's default: the embedded model baked into the image
    assert (arg(embedded, "--dtype"), arg(embedded, "--device")) == ("float32", "cpu")
    assert "--quantization" not in embedded  # unquantized is the runtime's default


A4000_X2 = ("NVIDIA-RTX-A4000", 16376, 2)  # 16 GB GPUs, two per node: an 8B bf16 model needs both


def tensor_parallel_plan(size: dict[str, Any] | None = None) -> Plan:
    model = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-8B-Instruct"}}
    if size:
        model = {"source": "pvc", "pvc": {"claimName": "w"}, "size": size}
    spec = {"model": model, "placement": {"maxGpusPerReplica": 2}}
    return make_plan(cr(spec), [node_info(make_node("a", gpu=A4000_X2))])


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_tensor_parallel_replica_asks_for_its_gpus_and_passes_the_size() -> None:
    plan = tensor_parallel_plan()
    [dep] = plan.deployments
    main = container(dep)
    assert arg(main["args"], "--tensor-parallel-size") == "2"
    assert main["resources"]["limits"]["nvidia.com/gpu"] == main["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert arg(main["args"], "--dtype") == "bfloat16" and "--quantization" not in main["args"]
    one_gpu = container(deployment(plan_for("pvc-8b"), "gpu-h100-80gb-hbm3"))["args"]
    assert "--tensor-parallel-size" not in one_gpu  # the runtime's default is 1


@pytest.mark.parametrize(
    "size",
    [
        None,  # Llama-3.1-8B: 8 KV heads, 4 per rank
        {"parameters": "10B", "numLayers": 30, "numKVHeads": 3, "numHeads": 9, "headDim": 64},  # 2 + 1 KV heads
    ],
)
def test_kv_cache_memory_is_per_rank_and_every_rank_holds_the_profiles_tokens(size: dict[str, Any] | None) -> None:
    parallel = pytest.importorskip("hpi_runtime.models.parallel")
    from hpi_contracts.kv_cache import kv_bytes_per_token
    from hpi_runtime.core.kv_budget import num_blocks_for_budget

    plan = tensor_parallel_plan(size)
    [choice] = plan.choices
    profile = choice.profile
    assert profile is not None and profile.num_gpus == 2, choice.reason
    shape = model_shape(plan.spec.model)
    engine = plan.spec.engine
    per_rank_bytes = int(arg(container(plan.deployments[0])["args"], "--kv-cache-memory"))
    # What the runtime does with it (worker/executor.py): each rank sizes blocks for its own KV heads, and all
    # ranks take the smallest count.
    rank_heads = [parallel.split_heads(shape.num_heads, shape.num_kv_heads, 2, r).kv.size for r in range(2)]
    rank_token_bytes = [kv_bytes_per_token(shape.num_layers, h, shape.head_dim, 2) for h in rank_heads]
    num_blocks = min(
        num_blocks_for_budget(per_rank_bytes, b, engine.block_size, engine.max_model_len) for b in rank_token_bytes
    )
    allocated = [num_blocks * engine.block_size * b for b in rank_token_bytes]
    assert sum(allocated) <= profile.kv_cache_bytes  # the replica never takes more KV memory than planned
    assert max(allocated) <= per_rank_bytes
    planned_tokens = profile.kv_cache_bytes // replica_kv_bytes_per_token(shape, profile.dtype, 2)
    assert num_blocks * engine.block_size >= planned_tokens - engine.block_size  # nor fewer tokens


def test_fp8_kv_cache_reaches_every_runtime_and_halves_the_kv_arithmetic() -> None:
    """spec.engine.kvCacheDtype fp8: `--kv-cache-dtype fp8` on every pool's runtime, and each profile counts one
    byte a K/V element (Llama-3.1-8B: 64 KiB a token against bf16's 128 KiB), so the minimum KV halves."""
    bf16 = plan_for("pvc-8b")
    fp8 = make_plan(cr({**copy.deepcopy(SPECS["pvc-8b"]), "engine": {"kvCacheDtype": "fp8"}}), NODES)
    assert fp8.deployments and len(fp8.choices) == len(bf16.choices)
    for dep in fp8.deployments:
        assert arg(container(dep)["args"], "--kv-cache-dtype") == "fp8"
    assert all("--kv-cache-dtype" not in container(dep)["args"] for dep in bf16.deployments)  # auto: the default
    gpu = {c.pool.name: c for c in fp8.choices}["gpu-h100-80gb-hbm3"]
    assert "tokens x 65536 B)" in gpu.reason, gpu.reason
    assert "tokens x 131072 B)" in {c.pool.name: c for c in bf16.choices}["gpu-h100-80gb-hbm3"].reason


def test_bfloat16_kv_cache_halves_the_fp32_pools_kv_and_leaves_fp16_pools_their_cache() -> None:
    """spec.engine.kvCacheDtype bfloat16: the fp32 CPU pool's runtime gets `--kv-cache-dtype bfloat16` and its
    profile counts two bytes a K/V element (half of fp32's); the bf16 pools get it too (a no-op there); the fp16 T4
    pool keeps its own two-byte cache (no flag), as a GPU without bf16 should."""
    auto = plan_for("embedded")
    bf16 = make_plan(cr({**copy.deepcopy(SPECS["embedded"]), "engine": {"kvCacheDtype": "bfloat16"}}), NODES)
    args = {c.pool.name: container(deployment(bf16, c.pool.name))["args"] for c in bf16.choices}
    assert arg(args["cpu-amd64"], "--kv-cache-dtype") == arg(args["cpu-amd64-bf16"], "--kv-cache-dtype") == "bfloat16"
    assert "--kv-cache-dtype" not in args["gpu-t4"] and arg(args["gpu-t4"], "--dtype") == "float16"
    reasons = {c.pool.name: (c.reason, a.reason) for c, a in zip(bf16.choices, auto.choices, strict=True)}
    assert "tokens x 23040 B)" in reasons["cpu-amd64"][0] and "tokens x 46080 B)" in reasons["cpu-amd64"][1]
    assert all("tokens x 23040 B)" in ours and "tokens x 23040 B)" in theirs
               for name, (ours, theirs) in reasons.items() if name != "cpu-amd64")  # fmt: skip


def test_runtime_parser_accepts_the_rendered_args() -> None:
    from hpi_runtime.cli import build_parser  # the test environment has every component installed

    parser = build_parser()
    plans = [plan_for(key) for key in SPECS] + [tensor_parallel_plan()]
    for plan in plans:
        for dep in plan.deployments:
            main = container(dep)
            assert main["command"] == ["hpi"]
            args, unknown = parser.parse_known_args(main["args"])
            assert args.command == "serve" and args.port == 8000
            assert unknown == [], unknown
            assert args.tensor_parallel_size == int(main["resources"]["limits"].get("nvidia.com/gpu", 1))


def test_every_flag_the_operator_emits_is_in_the_runtime_flag_contract() -> None:
    """The contract is generated from the runtime's config tree (tests/runtime/test_config.py keeps it fresh), so a
    flag renamed or removed in the runtime fails here, without importing the runtime."""
    plans = [plan_for(key) for key in SPECS] + [tensor_parallel_plan()]
    emitted = {a for plan in plans for dep in plan.deployments for a in container(dep)["args"] if a.startswith("--")}
    assert {"--block-size", "--kv-cache-memory", "--served-model-name", "--drain-timeout"} <= emitted
    assert emitted <= set(SERVE_FLAGS), emitted - set(SERVE_FLAGS)


def test_serve_args_refuses_what_the_runtime_would_refuse() -> None:
    assert serve_args({"--block-size": 32, "--model": None, "--enforce-eager": True}) == [
        "--block-size", "32", "--enforce-eager"]  # fmt: skip
    with pytest.raises(ValueError, match="no flag --block-sise"):
        serve_args({"--block-sise": 16})
    with pytest.raises(ValueError, match="--block-size must be one of 8, 16, 32, 64, 128; got 12"):
        serve_args({"--block-size": 12})


def test_service_and_pdb_select_every_pool() -> None:
    plan = service_mode("embedded")
    selector = {"serving.hpi.dev/inference-deployment": "demo"}
    assert plan.service["spec"]["selector"] == selector
    assert plan.pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
    for dep in plan.deployments:
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert plan.selector == "serving.hpi.dev/inference-deployment=demo"


def test_hashes_are_stable_and_move_with_the_spec() -> None:
    first, again = plan_for("embedded"), plan_for("embedded")
    assert first.fingerprint == again.fingerprint
    for child in first.children:
        assert child["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == spec_hash(child)
    scaled = make_plan(cr({**SPECS["embedded"], "replicas": 3}), NODES)
    assert scaled.fingerprint != first.fingerprint
    assert scaled.service == first.service  # replicas touch only the Deployments


def test_long_names_are_cut_with_a_hash() -> None:
    name = "a" * 52
    plan = make_plan(cr(SPECS["embedded"], name=name), NODES)
    for child in plan.children:
        assert len(child["metadata"]["name"]) <= 63
        for value in child["metadata"]["labels"].values():
            assert len(value) <= 63
    assert short_name("x" * 70) != short_name("x" * 69 + "y")
    kubernetes_validate.validate(plan.deployments[0], K8S_VERSIONS[-1], strict=True)
