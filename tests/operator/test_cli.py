"""`hpi-operator render` offline, on the example node lists; the operator package stays torch-free."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

from hpi_contracts import metrics
from hpi_operator.cli import main, render

REPO = Path(__file__).resolve().parents[2]
NODE_LISTS = REPO / "examples" / "nodes"


def write(tmp_path: Path, name: str, docs: list[dict]) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


CR = {"apiVersion": "serving.hpi.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "demo"},
      "spec": {"replicas": 3}}  # fmt: skip


def test_render_prints_valid_manifests_for_a_mixed_cluster(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = render(write(tmp_path, "cr.yaml", [CR]), str(NODE_LISTS / "mixed-nodes.yaml"), out, err)
    assert code == 0, err.getvalue()
    docs = list(yaml.safe_load_all(out.getvalue()))
    kinds = [d["kind"] for d in docs]
    assert kinds.count("Deployment") == 5 and kinds[-2:] == ["Service", "PodDisruptionBudget"]
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    pools = {"demo-gpu-l4", "demo-gpu-t4", "demo-cpu-amd64-bf16", "demo-cpu-amd64"}  # NotReady etc. skipped
    assert names == pools | {"demo-router"}  # several pools: the router is the default routing
    assert {"ServiceAccount", "Role", "RoleBinding"} <= set(kinds)
    for doc in docs:
        assert doc["metadata"]["namespace"] == "default"
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    assert "pool gpu-l4: 2 replica(s)" in err.getvalue()
    assert "# demo routing: router" in err.getvalue()


def test_render_reports_a_model_that_fits_nowhere(tmp_path: Path) -> None:
    cr = {**CR, "spec": {"model": {"source": "huggingface", "huggingface": {"id": "meta-llama/Llama-3.1-70B-Instruct"}},
                         "placement": {"profile": {"quantization": "none"}}}}  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    assert render(write(tmp_path, "cr.yaml", [cr]), str(NODE_LISTS / "cpu-nodes.yaml"), out, err) == 2
    assert "no node pool can serve this model" in err.getvalue()
    assert "does not fit" in err.getvalue()


def test_render_reports_an_invalid_spec_and_missing_crs(tmp_path: Path) -> None:
    bad = {**CR, "spec": {"model": {"source": "pvc"}}}
    out, err = io.StringIO(), io.StringIO()
    assert render(write(tmp_path, "cr.yaml", [bad]), str(NODE_LISTS / "cpu-nodes.yaml"), out, err) == 2
    assert "claimName" in err.getvalue()
    assert render(write(tmp_path, "empty.yaml", [{"kind": "ConfigMap"}]), str(NODE_LISTS / "cpu-nodes.yaml"),
                  out, err) == 2  # fmt: skip


def test_every_example_renders_on_its_node_list(capsys) -> None:  # type: ignore[no-untyped-def]
    pairs = {"embedded-cpu.yaml": "cpu-nodes.yaml", "gpu-autoscaling.yaml": "gpu-nodes.yaml",
             "mixed-gpu-cpu.yaml": "mixed-nodes.yaml", "llama-405b-multi-node.yaml": "gpu-nodes.yaml"}  # fmt: skip
    for example, nodes in pairs.items():
        assert main(["render", "-f", str(REPO / "examples" / example), "--nodes", str(NODE_LISTS / nodes)]) == 0
        kind = "LeaderWorkerSet" if "multi-node" in example else "Deployment"
        assert f"kind: {kind}" in capsys.readouterr().out


def test_cli_help_and_console_script() -> None:
    result = subprocess.run([sys.executable, "-m", "hpi_operator.cli", "render", "--help"], capture_output=True,
                            text=True, cwd=REPO)  # fmt: skip
    assert result.returncode == 0 and "--nodes" in result.stdout


def test_operator_package_imports_no_torch() -> None:
    code = ("import sys, hpi_operator.cli, hpi_operator.handlers, hpi_operator.plan; "
            "assert 'torch' not in sys.modules and 'hpi_runtime' not in sys.modules")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_metric_names_are_vllm_names() -> None:
    assert metrics.READ_BY_OPERATOR == (
        "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:num_preemptions",
        "vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
        "vllm:request_time_per_output_token_seconds",
    )  # fmt: skip
    assert all(name.startswith("vllm:") for name in metrics.READ_BY_OPERATOR)
