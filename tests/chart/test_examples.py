"""examples/: every InferenceDeployment validates against the CRD, parses in the operator, and renders (with
its sample node list, through `hpi-operator render`) into manifests that pass `kubernetes-validate --strict`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from hpi_testing.crd_schema import apply_schema, crd_schemas

# LWS's published CRD (see tests/operator/test_multi_node.py for its provenance).
LWS_CRD = json.loads((Path(__file__).parents[1] / "operator" / "data" / "leaderworkerset-v1-crd.json").read_text())
LWS_SCHEMA = crd_schemas(LWS_CRD)["leaderworkerset.x-k8s.io/v1/leaderworkersets"]

EXAMPLES = {
    "embedded-cpu.yaml": "cpu-nodes.yaml",
    "gpu-autoscaling.yaml": "gpu-nodes.yaml",
    "huggingface-cache.yaml": "gpu-nodes.yaml",
    "mixed-gpu-cpu.yaml": "mixed-nodes.yaml",
    "llama-405b-multi-node.yaml": "gpu-nodes.yaml",
}


def load(env, name):
    return yaml.safe_load((env.repo / "examples" / name).read_text())


def render_example(env, example):
    from hpi_operator import cli

    out, err = io.StringIO(), io.StringIO()
    nodes = env.repo / "examples" / "nodes" / EXAMPLES[example]
    code = cli.render(str(env.repo / "examples" / example), str(nodes), out=out, err=err)
    assert code == 0, f"hpi-operator render -f examples/{example} failed:\n{err.getvalue()}"
    return [d for d in yaml.safe_load_all(out.getvalue()) if d]


def runtime_deployments(manifests):
    """The runtime Deployments (one per pool), not the router's or the endpoint picker's."""
    return [m for m in manifests if m["kind"] == "Deployment"
            and m["metadata"]["labels"]["app.kubernetes.io/component"] == "inference"]  # fmt: skip


def test_every_example_is_covered(env):
    on_disk = {p.name for p in (env.repo / "examples").glob("*.yaml")}
    assert on_disk == set(EXAMPLES)
    nodes = {p.name for p in (env.repo / "examples" / "nodes").glob("*.yaml")}
    assert nodes == set(EXAMPLES.values())


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_matches_the_crd_schema(env, idp_validator, example):
    errors = env.schema_errors(idp_validator, load(env, example))
    assert not errors, f"examples/{example}: {errors}"


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_parses_in_the_operator(env, example):
    from hpi_operator.spec import parse_spec

    parse_spec(load(env, example)["spec"])  # SpecError: a rule the schema cannot express is broken


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_renders_valid_manifests(env, example):
    manifests = render_example(env, example)
    kinds = {m["kind"] for m in manifests}
    assert "Service" in kinds and kinds & {"Deployment", "LeaderWorkerSet"}
    for manifest in manifests:
        if manifest["kind"] == "LeaderWorkerSet":  # not a built-in kind: LWS's own published schema
            checked = apply_schema(manifest, LWS_SCHEMA)
            assert checked.errors == () and checked.pruned == (), (checked.errors, checked.pruned)
            continue
        for version in env.kube_versions:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"examples/{example}: {manifest['kind']}/{manifest['metadata']['name']}: {e}")


@pytest.mark.parametrize("nodes", sorted(set(EXAMPLES.values())))
def test_sample_node_lists_are_valid_nodes(env, nodes):
    listing = yaml.safe_load((env.repo / "examples" / "nodes" / nodes).read_text())
    assert listing["kind"] == "List" and listing["items"]
    for node in listing["items"]:
        kubernetes_validate.validate(node, env.kube_versions[-1], strict=True)


def test_embedded_example_runs_on_cpu_without_network(env):
    spec = load(env, "embedded-cpu.yaml")["spec"]
    assert spec["model"]["source"] == "embedded" and spec["placement"]["profile"]["device"] == "cpu"
    for deployment in runtime_deployments(render_example(env, "embedded-cpu.yaml")):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert "--model" not in container["args"]  # the runtime's baked-in default model
        assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_gpu_example_autoscales_on_gpus(env):
    spec = load(env, "gpu-autoscaling.yaml")["spec"]
    assert spec["autoscaling"]["enabled"] is True and spec["placement"]["profile"]["device"] == "cuda"
    deployments = runtime_deployments(render_example(env, "gpu-autoscaling.yaml"))
    assert deployments
    for deployment in deployments:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_mixed_example_spans_gpu_and_cpu_pools(env):
    manifests = render_example(env, "mixed-gpu-cpu.yaml")
    deployments = runtime_deployments(manifests)
    limits = [d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] for d in deployments]
    on_gpu = [limit for limit in limits if "nvidia.com/gpu" in limit]
    assert on_gpu and len(on_gpu) < len(deployments), "expected replicas on both a GPU pool and a CPU pool"
    assert sum(d["spec"]["replicas"] for d in deployments) == load(env, "mixed-gpu-cpu.yaml")["spec"]["replicas"]
    # Traffic follows capacity: the Service clients call reaches the router, the router finds the pools' pods.
    services = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Service"}
    name = load(env, "mixed-gpu-cpu.yaml")["metadata"]["name"]
    assert services[name]["spec"]["selector"] == {"serving.hpi.dev/router": name}
    assert services[f"{name}-backends"]["spec"]["clusterIP"] == "None"
