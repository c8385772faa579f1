"""Quantization through the public edges: `hpi serve` flags, create_engine's footprint, LLM generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpi_runtime.cli import build_parser
from hpi_runtime.llm import LLM, LoadConfig, create_engine
from hpi_runtime.model.quant_linear import QuantizedLinear
from hpi_runtime.model.quantization import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES
from hpi_runtime.sampling_params import SamplingParams


def test_serve_flags() -> None:
    args = build_parser().parse_args(["serve", "--quantization", "int4", "--quantization-group-size", "64"])
    assert (args.quantization, args.quantization_group_size) == ("int4", 64)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.quantization, defaults.quantization_group_size, defaults.quantize_lm_head) == (
        "none", DEFAULT_INT4_GROUP_SIZE, False
    )  # fmt: skip
    assert build_parser().parse_args(["serve", "--quantize-lm-head"]).quantize_lm_head
    # The CLI spells the group sizes out (it must not import torch to parse); they must stay the library's.
    for size in (16, *INT4_GROUP_SIZES, 256):
        if size in INT4_GROUP_SIZES:
            assert build_parser().parse_args(["serve", "--quantization-group-size", str(size)])
        else:
            with pytest.raises(SystemExit):
                build_parser().parse_args(["serve", "--quantization-group-size", str(size)])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "fp8"])


def test_engine_reports_the_quantized_weight_footprint(tiny_model_dir: Path) -> None:
    footprints = {}
    for method in ("none", "int8", "int4"):
        load = LoadConfig(dtype="float32", quantization=method, kv_cache_memory_bytes=1 << 20)
        bundle = create_engine(tiny_model_dir, load=load)
        footprints[method] = bundle.weight_bytes
        assert bundle.quantization == method
    # Tiny model: 2 layers of 64x(128 qkv + 64 o + 256 gate_up) + 128x64 down linears = 73728 weights, the
    # float embedding (vocab x 64) is shared by the LM head and stays fp32.
    linear_weights = 2 * (64 * (128 + 64 + 256) + 128 * 64)
    assert footprints["none"] - footprints["int8"] >= linear_weights * (4 - 1) - 2 * 2 * (128 + 64 + 256 + 64)
    assert footprints["int4"] < footprints["int8"]


def test_llm_generates_with_quantized_linears(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, dtype="float32", quantization="int4", kv_cache_memory_bytes=1 << 20, max_model_len=64)
    model = llm.engine.executor.model
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 8
