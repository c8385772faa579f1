"""Secure defaults of the operator Deployment, and the wiring between its args, ports and probe."""

from __future__ import annotations


def operator_deployment(render, env, values=None):
    (deployment,) = env.by_kind(render(values), "Deployment")
    return deployment


def test_pod_runs_as_non_root_with_runtime_default_seccomp(render, env):
    pod = operator_deployment(render, env)["spec"]["template"]["spec"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] > 0 and security["runAsGroup"] > 0
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod.get("hostNetwork") is not True and pod.get("hostPID") is not True and pod.get("hostIPC") is not True


def test_container_is_locked_down(render, env):
    (container,) = operator_deployment(render, env)["spec"]["template"]["spec"]["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["privileged"] is False
    assert security["runAsNonRoot"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    # A read-only root needs a writable scratch directory.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_resources_have_requests_and_limits(render, env):
    (container,) = operator_deployment(render, env)["spec"]["template"]["spec"]["containers"]
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    assert "memory" in container["resources"]["limits"]


def test_image_is_pinned_to_the_app_version(render, env):
    import yaml

    app_version = yaml.safe_load((env.chart / "Chart.yaml").read_text())["appVersion"]
    (container,) = operator_deployment(render, env)["spec"]["template"]["spec"]["containers"]
    assert container["image"].endswith(f":{app_version}")


def test_one_operator_at_a_time(render, env):
    spec = operator_deployment(render, env)["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}  # no overlap during upgrades either


def test_operator_command_and_probe_agree(render, env):
    """`hpi-operator run` serves kopf's liveness endpoint and metrics on the ports the probe and Service use."""
    values = {"operator": {"livenessPort": 18080, "metricsPort": 19090}}
    pod = operator_deployment(render, env, values)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["hpi-operator"]
    assert container["args"][0] == "run"
    assert "--liveness=http://0.0.0.0:18080/healthz" in container["args"]
    assert "--metrics-port=19090" in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"healthz": 18080, "metrics": 19090}
    probe = container["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "healthz"}


def test_operator_args_are_flags_the_cli_accepts(render, env):
    """Every flag the chart passes parses with the operator's own argument parser (no drift between them)."""
    import argparse
    from unittest import mock

    from hpi_operator import cli

    captured = {}

    def fake_run(args: argparse.Namespace) -> int:
        captured["args"] = args
        return 0

    for values in ({}, env.all_features):
        (container,) = operator_deployment(render, env, values)["spec"]["template"]["spec"]["containers"]
        with mock.patch.object(cli, "run", fake_run):
            assert cli.main(container["args"]) == 0
        parsed = captured["args"]
        assert parsed.command == "run"
        assert parsed.liveness.endswith("/healthz") and parsed.metrics_port == 9090
    assert parsed.namespace == ["team-a"] and parsed.debug is True


def test_watch_namespace_selects_the_namespace(render, env):
    default_args = operator_deployment(render, env)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--namespace") for a in default_args)  # every namespace
    args = operator_deployment(render, env, {"operator": {"watchNamespace": "team-a"}})["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--namespace=team-a" in args


def test_service_account_token_only_where_needed(render, env):
    manifests = render()
    (account,) = env.by_kind(manifests, "ServiceAccount")
    pod = env.by_kind(manifests, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True  # the operator is an API client
    assert pod["enableServiceLinks"] is False
