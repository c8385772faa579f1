"""values.schema.json: helm refuses bad values before anything reaches the cluster."""

from __future__ import annotations

import json

import pytest

BAD_VALUES = {
    "negative replicas": {"replicaCount": -1},
    "two operators": {"replicaCount": 2},
    "replicas as a string": {"replicaCount": "one"},
    "unknown top-level key (typo)": {"replicaCont": 1},
    "unknown nested key (typo)": {"operator": {"watchNamespaces": "a"}},
    "pull policy not an enum": {"image": {"pullPolicy": "Sometimes"}},
    "latest tag": {"image": {"tag": "latest"}},
    "log level not an enum": {"operator": {"logLevel": "trace"}},
    "port out of range": {"operator": {"metricsPort": 70000}},
    "port as a string": {"metrics": {"service": {"port": "9090"}}},
    "namespace not a DNS label": {"operator": {"watchNamespace": "Team_A"}},
    "rbac.create not a boolean": {"rbac": {"create": "yes"}},
    "service type not an enum": {"metrics": {"service": {"type": "ExternalName"}}},
    "scrape interval not a duration": {"metrics": {"serviceMonitor": {"interval": "30 seconds"}}},
    "runAsUser root": {"podSecurityContext": {"runAsUser": 0}},
    "default deployment device not an enum": {"defaultInferenceDeployment": {"device": "tpu"}},
    "default deployment negative replicas": {"defaultInferenceDeployment": {"replicas": -2}},
    "default deployment name too long": {"defaultInferenceDeployment": {"name": "n" * 53}},
    "resources with an unknown section": {"resources": {"request": {"cpu": "1"}}},
    "extra args not strings": {"operator": {"extraArgs": [1, 2]}},
    "network policy peer not an object": {"networkPolicy": {"prometheus": ["monitoring"]}},
    "network policy peer with a typo": {"networkPolicy": {"prometheus": [{"podSelectr": {}}]}},
    "network policy empty peer": {"networkPolicy": {"prometheus": [{}]}},
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_rejects_bad_values(helm, env, values):
    result = env.run_helm(helm, "template", env.release, str(env.chart), values=values)
    assert result.returncode != 0, f"helm accepted {values}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr


def test_schema_rejects_bad_values_given_with_set(helm, env):
    result = env.run_helm(helm, "template", env.release, str(env.chart), "--set", "replicaCount=-1")
    assert result.returncode != 0
    assert "replicaCount" in result.stderr


def test_schema_accepts_the_defaults_and_every_feature(helm, env):
    for values in ({}, env.all_features, {"replicaCount": 0}):
        result = env.run_helm(helm, "template", env.release, str(env.chart), values=values)
        assert result.returncode == 0, result.stderr


def test_schema_covers_every_top_level_value(env):
    import yaml

    values = yaml.safe_load((env.chart / "values.yaml").read_text())
    schema = json.loads((env.chart / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    assert set(values) <= set(schema["properties"]), set(values) - set(schema["properties"])
