"""`helm lint --strict` over the chart: default values, every optional feature on, and a single namespace."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("scenario", ["defaults", "all-features", "namespaced-only"])
def test_helm_lint_strict(helm, env, scenario):
    values = {
        "defaults": {},
        "all-features": env.all_features,
        "namespaced-only": {"operator": {"watchNamespace": "inference"}},
    }[scenario]
    result = env.run_helm(helm, "lint", "--strict", str(env.chart), values=values)
    assert result.returncode == 0, f"helm lint --strict failed:\n{result.stdout}\n{result.stderr}"
    assert "0 chart(s) failed" in result.stdout


def test_chart_metadata_matches_the_operator(env):
    import yaml

    chart = yaml.safe_load((env.chart / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == env.chart.name
    values = yaml.safe_load((env.chart / "values.yaml").read_text())
    # The operator image defaults to the chart's appVersion: never to a moving tag.
    assert values["image"]["tag"] == "" and chart["appVersion"] != "latest"


def test_every_value_has_a_comment(env):
    """Each value in values.yaml is documented: a comment right above it or above an enclosing key."""
    lines = (env.chart / "values.yaml").read_text().splitlines()
    commented: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    undocumented = []
    for number, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("- ") or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while commented and commented[-1][0] >= indent:
            commented.pop()
        documented = number > 0 and lines[number - 1].strip().startswith("#")
        inherited = any(flag for _, flag in commented)
        is_leaf = stripped.partition(":")[2].strip() != ""
        if is_leaf and not (documented or inherited):
            undocumented.append(f"values.yaml:{number + 1}: {stripped}")
        commented.append((indent, documented))
    assert not undocumented, "values without a comment:\n" + "\n".join(undocumented)
