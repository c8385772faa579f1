"""One tiny random Qwen2-VL for the multimodal tests, built once per session (no download), and its reference:
transformers' own Qwen2VLForConditionalGeneration over the same directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_testing.tiny_vlm import build_tiny_qwen2_vl


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="session")
def hf_vlm(tiny_vlm_dir):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(
        tiny_vlm_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()

