"""`helm template` renders manifests that pass `kubernetes-validate --strict`; custom resources are checked
against their own schemas (the InferenceDeployment against the CRD, the ServiceMonitor and PodMonitor against
the subset of prometheus-operator's schema the chart uses)."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest

# The ServiceMonitor fields the chart renders, typed as in prometheus-operator's monitoring.coreos.com/v1 CRD
# (its duration pattern included); unknown fields are rejected so a typo cannot slip through.
_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {  # a metav1.LabelSelectorRequirement each
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["key", "operator"],
                                "additionalProperties": False,
                                "properties": {
                                    "key": {"type": "string"},
                                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                    "values": {"type": "array", "items": {"type": "string"}},
                                },
                            },
                        },
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                        },
                    },
                },
            },
        },
    },
}

# The PodMonitor fields the chart renders, typed as in prometheus-operator's monitoring.coreos.com/v1 CRD;
# unknown fields are rejected so a typo cannot slip through.
POD_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {  # a metav1.LabelSelectorRequirement each
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["key", "operator"],
                                "additionalProperties": False,
                                "properties": {
                                    "key": {"type": "string"},
                                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                    "values": {"type": "array", "items": {"type": "string"}},
                                },
                            },
                        },
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {
                                            "type": "array",
                                            "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
                                        },
                                        "targetLabel": {"type": "string"},
                                        "action": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
SCENARIOS = ["defaults", "all-features", "no-rbac-existing-account", "long-release-name"]


def scenario_values(env, scenario):
    return {
        "defaults": {},
        "all-features": env.all_features,
        "no-rbac-existing-account": {
            "rbac": {"create": False},
            "serviceAccount": {"create": False, "name": "platform-operator"},
            "metrics": {"service": {"enabled": False}},
        },
        "long-release-name": {"defaultInferenceDeployment": {"enabled": True}},
    }[scenario]


# Helm caps release names at 53 characters; with the chart name appended that is 72, cut to 63.
LONG_RELEASE = "inference-platform-production-europe-west4-blue-green"


def validate(manifest, kube_version, idp_validator, env):
    kind = manifest["kind"]
    if kind == "InferenceDeployment":
        errors = env.schema_errors(idp_validator, manifest)
        assert not errors, f"InferenceDeployment does not match the CRD: {errors}"
    elif kind == "ServiceMonitor":
        jsonschema.validate(manifest, SERVICE_MONITOR_SCHEMA)
    elif kind == "PodMonitor":
        jsonschema.validate(manifest, POD_MONITOR_SCHEMA)
    else:
        try:
            kubernetes_validate.validate(manifest, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kind}/{manifest['metadata']['name']} is invalid for Kubernetes {kube_version}: {e}")


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("kube_version", ["1.27.0", "1.37.0"])
def test_rendered_manifests_validate_strictly(render, env, idp_validator, scenario, kube_version):
    release = LONG_RELEASE if scenario == "long-release-name" else env.release
    manifests = render(scenario_values(env, scenario), kube_version=kube_version, release=release)
    assert manifests
    for manifest in manifests:
        validate(manifest, kube_version, idp_validator, env)


def test_default_render_has_exactly_the_operator_objects(render, env):
    kinds = sorted(m["kind"] for m in render())
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"])


def test_optional_objects_appear_only_when_enabled(render, env):
    kinds = [m["kind"] for m in render(env.all_features)]
    optional = ("ServiceMonitor", "PodMonitor", "ConfigMap", "InferenceDeployment", "Role", "RoleBinding",
                "NetworkPolicy")
    for kind in optional:
        assert kinds.count(kind) == 1, kind
    assert not set(optional) & {m["kind"] for m in render()}


def test_no_rbac_and_an_existing_service_account(render, env):
    manifests = render(scenario_values(env, "no-rbac-existing-account"))
    assert sorted(m["kind"] for m in manifests) == ["Deployment"]
    pod = manifests[0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "platform-operator"


def test_names_are_cut_to_63_characters(render, env):
    assert len(LONG_RELEASE) == 53
    manifests = render(scenario_values(env, "long-release-name"), release=LONG_RELEASE)
    for manifest in manifests:
        name = manifest["metadata"]["name"]
        assert len(name) <= 63 and not name.endswith("-"), name
    (idp,) = env.by_kind(manifests, "InferenceDeployment")
    assert len(idp["metadata"]["name"]) <= 52


def test_recommended_labels_on_every_object(render, env):
    for manifest in render(env.all_features):
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "hetero-paged-infer"
        assert labels["app.kubernetes.io/instance"] == env.release
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"].startswith("hetero-paged-infer-")


def test_metrics_service_selects_the_operator_pods(render, env):
    manifests = render()
    (service,) = env.by_kind(manifests, "Service")
    (deployment,) = env.by_kind(manifests, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}


def test_service_monitor_scrapes_the_metrics_service(render, env):
    manifests = render(env.all_features)
    (monitor,) = env.by_kind(manifests, "ServiceMonitor")
    (service,) = env.by_kind(manifests, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_service_monitor_without_the_service_fails_clearly(helm, env):
    values = {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}
    result = env.run_helm(helm, "template", env.release, str(env.chart), values=values)
    assert result.returncode != 0
    assert "metrics.serviceMonitor.enabled needs metrics.service.enabled" in result.stderr


def test_default_inference_deployment_serves_the_embedded_model(render, env):
    (idp,) = env.by_kind(render(env.all_features), "InferenceDeployment")
    assert idp["apiVersion"] == "serving.hpi.dev/v1alpha1"
    # all-features watches team-a only: the default InferenceDeployment must land where the operator looks.
    assert idp["metadata"]["namespace"] == env.all_features["operator"]["watchNamespace"] == "team-a"
    assert len(idp["metadata"]["name"]) <= 52  # the CRD's limit: children append pool names
    assert idp["spec"]["model"] == {"source": "embedded"}
    assert idp["spec"]["replicas"] == 2
    assert idp["spec"]["runtime"]["image"] == "registry.example.com/hpi/runtime:0.1.0"
    assert idp["spec"]["runtime"]["rocmImage"] == "registry.example.com/hpi/runtime:0.1.0-rocm"  # AMD GPU pools
    assert idp["spec"]["routing"] == {"router": {"image": "registry.example.com/hpi/router:0.1.0"}}


@pytest.mark.parametrize("scenario", ["defaults", "all-features"])
def test_notes_render_with_the_release_names(helm, env, tmp_path, scenario):
    """NOTES.txt only renders on install; wrapped into a manifest, `helm template` renders it offline."""
    import shutil

    import yaml

    chart = tmp_path / "chart"
    shutil.copytree(env.chart, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    wrapped = "notes: |\n" + "".join(f"  {line}\n" for line in notes.splitlines())
    (chart / "templates" / "notes-check.yaml").write_text(wrapped)
    values = scenario_values(env, scenario)
    result = env.run_helm(
        helm, "template", env.release, str(chart), "-n", env.namespace, "--show-only", "templates/notes-check.yaml",
        values=values,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = yaml.safe_load(result.stdout)["notes"]
    assert "<no value>" not in text
    assert f"kubectl -n {env.namespace} rollout status deployment/{env.release}-hetero-paged-infer" in text
    if scenario == "all-features":
        assert f"kubectl -n team-a get infdep {env.release}-hetero-paged-infer-embedded" in text
        assert 'namespace "team-a"' in text and "ServiceMonitor" in text
    else:
        assert "kind: InferenceDeployment" in text and "every namespace" in text
