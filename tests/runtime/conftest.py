"""Fixtures for runtime tests: tiny random models built locally (the embedded SmolLM2 directory: tests/conftest.py)."""

from __future__ import annotations

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
