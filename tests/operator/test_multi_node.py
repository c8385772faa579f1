"""Replicas that span nodes: the per-stage memory arithmetic, the layout choice (fewest nodes first, then
precision), spec.parallelism, and the LeaderWorkerSet a pool becomes, checked against LWS's own published CRD
schema (tests/operator/data/leaderworkerset-v1-crd.json: kubernetes-sigs/lws v0.10.0,
config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml at 2161f38ff333f9e24d3c44adef7cd5d9787cac00,
descriptions dropped, validation kept as published)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpi_contracts.pipeline_split import PP_LAYER_PARTITION_ENV
from hpi_operator.manifests_lws import EXCLUSIVE_TOPOLOGY_ANNOTATION
from hpi_operator.names import LABEL_DEPLOYMENT, LABEL_GROUP_MEMBER
from hpi_operator.nodes import group_pools, node_info
from hpi_operator.plan import make_plan
from hpi_operator.profiles import choose_profile
from hpi_operator.sizing import model_shape, stage_layers, stage_partition, stage_weight_bytes, weight_bytes
from hpi_operator.spec import SpecError, parse_spec
from hpi_testing.crd_schema import apply_schema, crd_schemas
from hpi_testing.kube_emulator import H100, make_node

LWS_CRD = json.loads((Path(__file__).parent / "data" / "leaderworkerset-v1-crd.json").read_text())
LWS_SCHEMA = crd_schemas(LWS_CRD)["leaderworkerset.x-k8s.io/v1/leaderworkersets"]
L4_X4 = ("NVIDIA-L4", 23034, 4)
L40S_X4 = ("NVIDIA-L40S", 46068, 4)
L4_X2 = ("NVIDIA-L4", 23034, 2)
LLAMA_405B = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-405B-Instruct"}}
LLAMA_70B = {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-70B-Instruct"}}


def nodes(gpu: tuple[str, int, int] | None, count: int, **extra: Any) -> list[Any]:
    return [node_info(make_node(f"n{i}", gpu=gpu, **extra)) for i in range(count)]


def choose(node_list: list[Any], model: dict[str, Any], **spec: Any) -> Any:
    [pool] = group_pools(node_list)
    parsed = parse_spec({"model": model, **spec})
    return choose_profile(pool, parsed, model_shape(parsed.model))


def cr(spec: dict[str, Any], name: str = "big") -> dict[str, Any]:
    return {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": "ml", "uid": "u-1", "generation": 1}, "spec": spec}  # fmt: skip


def lws_of(plan: Any) -> dict[str, Any]:
    [lws] = [c for c in plan.deployments if c["kind"] == "LeaderWorkerSet"]
    return lws


def args_of(template: dict[str, Any]) -> list[str]:
    return template["spec"]["containers"][0]["args"]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_a_stage_holds_its_share_of_the_layers_and_one_vocabulary_matrix() -> None:
    shape = model_shape(parse_spec({"model": LLAMA_405B}).model)
    # 126 layers, the LM head about 0.66 of a layer (128256 x 16384 against ~3.2e9 parameters a layer): the last
    # stage takes the smaller share, as the runtime splits them (hpi_contracts.pipeline_split).
    assert stage_partition(shape, 4) == (32, 32, 31, 31) and stage_partition(shape, 5) == (26, 25, 25, 25, 25)
    assert stage_layers(shape, 4) == 32 and stage_layers(shape, 5) == 26
    # The embedded model's head is 8 of its 3.5e6-parameter layers: 19 + (11 + 8), as its runtime splits it.
    assert stage_partition(model_shape(parse_spec({}).model), 2) == (19, 11)
    whole = weight_bytes(shape, "bf16", "int4")
    vocabulary = shape.vocab_size * shape.hidden_size * 2  # the embedding, and the untied head: bf16 both
    assert stage_weight_bytes(shape, "bf16", "int4", 1) == whole
    four = stage_weight_bytes(shape, "bf16", "int4", 4)
    # The first stage: 32 of the 126 layers and the embedding; the last: 31 layers and the head.
    assert four == pytest.approx((whole - 2 * vocabulary) * 32 / 126 + vocabulary, abs=1)
    assert whole / 4 < four < whole / 3  # the fullest stage, not an even quarter


def test_a_model_no_node_holds_says_how_many_nodes_would_and_spans_them_when_allowed() -> None:
    l4_nodes = nodes(L4_X4, 16)
    refused = choose(l4_nodes, LLAMA_405B)
    assert refused.profile is None
    assert "4 nodes per replica would hold it (cuda:bf16/int4 x4 x4 nodes)" in refused.reason
    assert "spec.placement.maxNodesPerReplica to 4" in refused.reason
    chosen = choose(l4_nodes, LLAMA_405B, placement={"maxNodesPerReplica": 16})
    profile = chosen.profile
    assert profile is not None and (profile.num_nodes, profile.num_gpus, profile.quantization) == (4, 4, "int4")
    assert "4 pipeline stages of 32+32+31+31 layers x 4 GPUs" in chosen.reason
    assert "none, int8 did not fit" in chosen.reason
    assert chosen.capacity == 4  # 16 nodes, 4 per group
    assert profile.needed_bytes <= profile.memory_budget_bytes  # per stage, within one node's 4 GPUs
    assert profile.memory_budget_bytes < 4 * 23034 * 2**20


def test_fewer_nodes_come_before_higher_precision() -> None:
    # 70B on nodes of 2 x L4: one node holds nothing; two hold int8; bf16 would need three.
    chosen = choose(nodes(L4_X2, 6), LLAMA_70B, placement={"maxNodesPerReplica": 4})
    assert chosen.profile is not None
    assert (chosen.profile.num_nodes, chosen.profile.quantization) == (2, "int8"), chosen.reason
    assert chosen.capacity == 3
    # A model one node holds never spans nodes, whatever the limit.
    single = choose(nodes(H100, 2), LLAMA_70B, placement={"maxNodesPerReplica": 8})
    assert single.profile is not None and single.profile.num_nodes == 1


def test_spec_parallelism_pins_the_layout_or_says_why_it_cannot() -> None:
    pinned = choose(nodes(L40S_X4, 8), LLAMA_405B, parallelism={"tensor": 4, "pipeline": 8})
    assert pinned.profile is not None and (pinned.profile.num_nodes, pinned.profile.num_gpus) == (8, 4)
    assert pinned.profile.quantization == "none"  # eight stages of 4 x 48 GB hold 405B in bf16
    assert "spec.parallelism" in pinned.reason
    assert "the pool has 4 nodes" in choose(nodes(L40S_X4, 4), LLAMA_405B, parallelism={"pipeline": 8}).reason
    assert "CPU pools run one rank per node" in choose(nodes(None, 2), LLAMA_70B, parallelism={"tensor": 2}).reason
    assert "these nodes have 4 GPUs" in choose(nodes(L40S_X4, 2), LLAMA_70B, parallelism={"tensor": 8}).reason
    for bad, message in (({"tensor": 3}, "tensor must be 1, 2, 4 or 8"), ({"pipeline": 0}, "pipeline must be 1 to")):
        with pytest.raises(SpecError, match=message):
            parse_spec({"model": LLAMA_70B, "parallelism": bad})
    with pytest.raises(SpecError, match="maxNodesPerReplica must be 1 to 64"):
        parse_spec({"placement": {"maxNodesPerReplica": 65}})


@pytest.mark.parametrize(("gpu", "count", "spec", "size"), [
    (L40S_X4, 4, {"placement": {"maxNodesPerReplica": 4}}, 2),  # needs 2 nodes: int4 does not fit one
    (L40S_X4, 8, {"parallelism": {"tensor": 4, "pipeline": 8}}, 8),
])  # fmt: skip
def test_the_pool_becomes_a_leaderworkerset_that_lws_own_schema_accepts(
    gpu: tuple[str, int, int], count: int, spec: dict[str, Any], size: int
) -> None:
    body = cr({"replicas": 2, "model": LLAMA_405B, **spec})
    plan = make_plan(body, nodes(gpu, count))
    lws = lws_of(plan)
    checked = apply_schema(lws, LWS_SCHEMA)
    assert checked.errors == () and checked.pruned == (), (checked.errors, checked.pruned)
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == size and lws["spec"]["replicas"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart" and lws["spec"]["startupPolicy"] == "LeaderCreated"
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    # Every pod runs the same command line: LWS's variables tell each its place in the group.
    assert args_of(leader) == args_of(worker)
    assert flag(args_of(leader), "--pipeline-parallel-size") == str(size)
    assert flag(args_of(leader), "--tensor-parallel-size") == "4"
    assert leader["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # Only leaders serve: the Service's and PDB's selector label, and the probes, are theirs.
    [backends] = [c for c in plan.routing if c["kind"] == "Service" and c["spec"].get("clusterIP") == "None"]
    assert backends["spec"]["selector"].items() <= leader["metadata"]["labels"].items()
    assert LABEL_DEPLOYMENT not in worker["metadata"]["labels"]
    assert plan.pdb["spec"]["selector"]["matchLabels"].items() <= leader["metadata"]["labels"].items()
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= leader["spec"]["containers"][0].keys()
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & worker["spec"]["containers"][0].keys()
    assert leader["metadata"]["labels"][LABEL_GROUP_MEMBER] == worker["metadata"]["labels"][LABEL_GROUP_MEMBER]
    assert not plan.profile_targets  # a group is not measured by a one-pod profiling Job
    [pool] = [p for p in plan.choices if p.profile is not None]
    assert f"x{size} nodes" in pool.profile.label()
    # Every pod loads the layers its memory was sized for: the operator's split, as the runtime's variable.
    partition = {e["name"]: e.get("value") for e in leader["spec"]["containers"][0]["env"]}[PP_LAYER_PARTITION_ENV]
    assert tuple(map(int, partition.split(","))) == pool.profile.layer_partition
    assert len(pool.profile.layer_partition) == size and sum(pool.profile.layer_partition) == 126
    assert leader["spec"]["containers"][0]["env"] == worker["spec"]["containers"][0]["env"]


def test_a_layer_partition_in_the_runtime_env_wins_over_the_operators() -> None:
    env = [{"name": PP_LAYER_PARTITION_ENV, "value": "70,56"}]
    plan = make_plan(cr({"model": LLAMA_405B, "placement": {"maxNodesPerReplica": 4}, "runtime": {"env": env}}),
                     nodes(L40S_X4, 4))  # fmt: skip
    for role in ("leaderTemplate", "workerTemplate"):
        container = lws_of(plan)["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"][0]
        assert [e for e in container["env"] if e["name"] == PP_LAYER_PARTITION_ENV] == env


def test_runtime_parser_accepts_the_group_args() -> None:
    from hpi_runtime.cli import build_parser  # the test environment has every component installed

    plan = make_plan(cr({"model": LLAMA_405B, "placement": {"maxNodesPerReplica": 4}}), nodes(L40S_X4, 4))
    args, unknown = build_parser().parse_known_args(args_of(lws_of(plan)["spec"]["leaderWorkerTemplate"]
                                                            ["leaderTemplate"]))  # fmt: skip
    assert unknown == [] and args.pipeline_parallel_size == 2 and args.tensor_parallel_size == 4


def test_topology_key_and_network_policy_of_a_group() -> None:
    spec = {"model": LLAMA_405B, "placement": {"maxNodesPerReplica": 4, "pools": [
        {"name": "gpu-l40s", "topologyKey": "cloud.google.com/gce-topology-block"}]},
        "networkPolicy": {"enabled": True}}  # fmt: skip
    plan = make_plan(cr(spec), nodes(L40S_X4, 4))
    lws = lws_of(plan)
    assert lws["metadata"]["annotations"][EXCLUSIVE_TOPOLOGY_ANNOTATION] == "cloud.google.com/gce-topology-block"
    [group] = [p for p in plan.network_policies if p["metadata"]["name"] == "big-group"]
    members = {LABEL_GROUP_MEMBER: "big"}
    assert group["spec"]["podSelector"]["matchLabels"] == members
    assert group["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": members}}]}]  # every port
    # Without a group, no such policy.
    single = make_plan(cr({**spec, "model": LLAMA_70B}), nodes(H100, 1))
    assert not [p for p in single.network_policies if p["metadata"]["name"] == "big-group"]


def test_status_counts_gpus_and_nodes_per_replica() -> None:
    from hpi_operator.status import pool_statuses

    plan = make_plan(cr({"model": LLAMA_405B, "placement": {"maxNodesPerReplica": 4}}), nodes(L40S_X4, 4))
    [entry] = [p for p in pool_statuses(plan, {}) if p.get("profile")]
    assert (entry["nodesPerReplica"], entry["gpusPerReplica"]) == (2, 8)
    assert entry["kvCacheBytes"] > 0 and entry["capacity"] == 2
    assert entry["deployment"] == lws_of(plan)["metadata"]["name"]


def test_a_group_costs_its_nodes_and_runs_its_stages_one_after_another() -> None:
    from hpi_operator.fleet.assumed import assumed_performance, gpu_figures
    from hpi_operator.fleet.pricing import NodePrices, label_price

    node_list = nodes(L40S_X4, 4)
    chosen = choose(node_list, LLAMA_405B, placement={"maxNodesPerReplica": 4})
    profile = chosen.profile
    assert profile is not None and profile.num_nodes == 2 and profile.num_gpus == 4
    price = label_price(chosen.pool, profile, NodePrices("price", {n.name: "10" for n in node_list}))
    assert price.cost_per_hour == pytest.approx(20.0)  # two whole nodes per replica
    shape = model_shape(parse_spec({"model": LLAMA_405B}).model)
    perf = assumed_performance("NVIDIA-L40S", profile, shape, 1000.0)
    figures = gpu_figures("NVIDIA-L40S")
    assert perf is not None and figures is not None
    one_stage_s = profile.weight_bytes / (figures.memory_bandwidth_gbps * 1e9 * 4)
    assert perf.itl_alpha_s > 2 * one_stage_s  # both stages' weights at one stage's bandwidth (and efficiency < 1)
