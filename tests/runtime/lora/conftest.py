"""Tiny PEFT adapters on the tiny model, built once per session with `peft` (random non-zero A and B)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpi_testing.lora_adapters import build_adapter


@pytest.fixture(scope="session")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three adapters of different ranks and targets: all seven projections, attention only, MLP only."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": build_adapter(tiny_model_dir, root / "all", rank=8, seed=1),
        "attn": build_adapter(tiny_model_dir, root / "attn", rank=4, targets=("q_proj", "v_proj"), seed=2),
        "mlp": build_adapter(
            tiny_model_dir, root / "mlp", rank=8, targets=("up_proj", "down_proj"), seed=3, use_rslora=True
        ),  # fmt: skip
    }
