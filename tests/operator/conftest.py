"""Fixtures for operator tests: the kmock-based API emulator on a loopback port, a kubeconfig pointing at
it, a kubernetes client, and a real kopf operator running against it in its own thread."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import kubernetes
import pytest
import yaml

from hpi_operator.handlers import OperatorConfig, build_registry
from hpi_operator.kube import KubeClient
from hpi_operator.op_metrics import OperatorMetrics
from hpi_testing.kube_emulator import KubeEmulator, install_crd, operator_thread, write_kubeconfig

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferencedeployments.serving.hpi.dev.yaml"
OPERATOR_MANAGERS = ("hpi-operator", "kopf")  # field managers of the operator's writes (its and kopf's user agent)


@pytest.fixture()
async def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator() as handler, kmock.Server(handler) as server:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(server.url).rstrip("/"))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        # The kubernetes client reads KUBECONFIG once, at import: kopf's login goes through that default.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        handler.objects["v1/namespaces", None, "default"] = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "default", "uid": "ns-default", "resourceVersion": "0"},
        }
        # The CRD as `kubectl apply -f crds/` installs it: its schema prunes, defaults and validates every write.
        install_crd(handler, yaml.safe_load(CRD_PATH.read_text()))
        yield handler
    # A field the schema does not declare (the CRD's, or a built-in kind's published one) vanishes on a real
    # cluster: here it fails the test instead.
    dropped = [entry for entry in handler.pruned if entry[0] in OPERATOR_MANAGERS]
    assert not dropped, f"the operator wrote fields outside the schema, which an API server drops: {dropped}"


@pytest.fixture()
def api(emulator: KubeEmulator) -> Iterator[kubernetes.client.ApiClient]:
    kubeconfig = kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION
    client = kubernetes.config.new_client_from_config(config_file=kubeconfig)
    yield client
    client.close()


@pytest.fixture()
def kube(api: kubernetes.client.ApiClient) -> KubeClient:
    """The tests' own client (its user agent keeps its calls apart from the operator's)."""
    return KubeClient(api, user_agent="hpi-tests")


@pytest.fixture()
def operator(api: kubernetes.client.ApiClient) -> Iterator[Any]:
    memo = kopf.Memo(kube=KubeClient(api), metrics=OperatorMetrics())
    with operator_thread(build_registry(OperatorConfig(resync_interval_s=0.5)), memo=memo):
        yield memo
