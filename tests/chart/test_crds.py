"""The CRD copies the chart and the operator package ship are generated from crds/ (`make crds`) and fresh."""

from __future__ import annotations

import importlib.util
import shutil


def _generator(env):
    spec = importlib.util.spec_from_file_location("hpi_crds_generate", env.repo / "crds" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_crd_copies_are_fresh(env):
    generator = _generator(env)
    assert len(generator.expected_copies()) == 2 * len(list((env.repo / "crds").glob("*.yaml"))) > 0
    assert generator.stale_copies() == [], "a CRD copy differs from crds/: run `make crds`"


def test_generator_finds_and_fixes_stale_and_stray_copies(env, tmp_path):
    generator = _generator(env)
    shutil.copytree(env.repo / "crds", tmp_path / "crds")
    generator.write_copies(tmp_path)
    assert generator.stale_copies(tmp_path) == []
    chart_copy = tmp_path / generator.COPY_DIRS[0] / "inferencedeployments.serving.hpi.dev.yaml"
    chart_copy.write_text(chart_copy.read_text().replace("default: 2", "default: 3"))
    stray = tmp_path / generator.COPY_DIRS[1] / "old.example.com.yaml"
    stray.write_text("kind: CustomResourceDefinition\n")
    assert generator.stale_copies(tmp_path) == [
        f"{generator.COPY_DIRS[0]}/inferencedeployments.serving.hpi.dev.yaml is stale",
        f"{generator.COPY_DIRS[1]}/old.example.com.yaml has no source in crds/",
    ]
    generator.write_copies(tmp_path)
    assert generator.stale_copies(tmp_path) == [] and not stray.exists()


def test_chart_crds_are_not_templated(env):
    # Helm installs crds/ verbatim (no templating), so a template directive there would reach the API server.
    for path in (env.chart / "crds").glob("*.yaml"):
        assert "{{" not in path.read_text(), path


def test_crd_kind_matches_the_default_inference_deployment(render, env):
    import yaml

    crd = yaml.safe_load(env.crd_file.read_text())
    (idp,) = env.by_kind(render(env.all_features), "InferenceDeployment")
    group, _, version = idp["apiVersion"].partition("/")
    assert (group, crd["spec"]["names"]["kind"]) == (crd["spec"]["group"], idp["kind"])
    assert version in {v["name"] for v in crd["spec"]["versions"] if v["served"]}
