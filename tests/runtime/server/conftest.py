"""A real `hpi serve` subprocess on the tiny random model, shared by the server tests of one module."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpi_testing.server import RuntimeServer

SERVED_NAME = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with RuntimeServer(
        tiny_model_dir, log,
        "--served-model-name", SERVED_NAME,
        "--max-model-len", "256",
        "--max-num-seqs", "32",
        "--max-request-body", "64KiB",
        "--kv-cache-memory", "8MiB",
        "--dtype", "float32",
    ) as running:
        yield running
