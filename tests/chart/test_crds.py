"""The chart carries the CRD: byte-identical to crds/, the source of truth."""

from __future__ import annotations


def test_chart_crds_equal_top_level_crds(env):
    top = {p.name: p.read_bytes() for p in sorted((env.repo / "crds").glob("*.yaml"))}
    chart = {p.name: p.read_bytes() for p in sorted((env.chart / "crds").glob("*.yaml"))}
    assert top, "crds/ holds no CRD yet"
    assert chart.keys() == top.keys(), "charts/hetero-paged-infer/crds/ and crds/ hold different files"
    for name in top:
        assert chart[name] == top[name], (
            f"charts/hetero-paged-infer/crds/{name} differs from crds/{name}; "
            "copy it: cp crds/*.yaml charts/hetero-paged-infer/crds/"
        )


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
