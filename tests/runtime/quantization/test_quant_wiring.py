"""Quantization through the public edges: `hpi serve` flags, create_engine's footprint, LLM generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_kernels.cpu import int4_a8_max_rows, int4_a8_tile, int8_a8_max_rows, int8_a8_tile
from hpi_runtime.cli import build_parser
from hpi_runtime.config import EngineArgs
from hpi_runtime.engine_factory import create_engine, resolve_engine
from hpi_runtime.llm import LLM
from hpi_runtime.quantization.linear import QuantizedLinear, a8_rows
from hpi_runtime.quantization.policy import _RULES, DEFAULT_INT4_POLICY, INT4_POLICIES, describe_policy, layer_method
from hpi_runtime.quantization.quantize import (
    ACTIVATIONS,
    DEFAULT_INT4_GROUP_SIZE,
    INT4_FITS,
    INT4_GROUP_SIZES,
    QuantizationConfig,
    ResolvedQuantization,
    resolve_activations,
)
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.server.metrics import ServingMetrics


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
    # The int4 fit and policy choices are spelled out in the CLI too: they must stay the library's.
    assert (defaults.int4_fit, defaults.int4_policy) == (INT4_FITS[0], DEFAULT_INT4_POLICY)
    for fit in INT4_FITS:
        assert build_parser().parse_args(["serve", "--int4-fit", fit]).int4_fit == fit
    for policy in INT4_POLICIES:
        assert build_parser().parse_args(["serve", "--int4-policy", policy]).int4_policy == policy
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--int4-policy", "q4_k_m"])
    for method in ("int4", "int8"):
        assert getattr(defaults, f"{method}_activations") == ACTIVATIONS[0] == "auto"
        for activations in ACTIVATIONS:
            parsed = build_parser().parse_args(["serve", f"--{method}-activations", activations])
            assert getattr(parsed, f"{method}_activations") == activations
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", f"--{method}-activations", "int4"])


def test_engine_reports_the_quantized_weight_footprint(tiny_model_dir: Path) -> None:
    footprints = {}
    for method in ("none", "int8", "int4"):
        args = EngineArgs.from_options(model=str(tiny_model_dir), dtype="float32", quantization=method,
                                       kv_cache_memory_bytes=1 << 20, enforce_eager=True)
        bundle = create_engine(args)
        footprints[method] = bundle.footprint.weight_bytes
        assert bundle.resolved.quantization == method
    # Tiny model: 2 layers of 64x(128 qkv + 64 o + 256 gate_up) + 128x64 down linears = 73728 weights, the
    # float embedding (vocab x 64) is shared by the LM head and stays fp32. int8 keeps one scale per output
    # channel, fp32 in hpi_kernels' CPU panels.
    linear_weights = 2 * (64 * (128 + 64 + 256) + 128 * 64)
    assert footprints["none"] - footprints["int8"] >= linear_weights * (4 - 1) - 2 * 4 * (128 + 64 + 256 + 64)
    assert footprints["int4"] < footprints["int8"]


def test_llm_generates_with_quantized_linears(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, dtype="float32", quantization="int4", kv_cache_memory_bytes=1 << 20, max_model_len=64)
    model = llm.engine.executor.model
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 8


def test_int4_scheme_and_policy_are_named_for_the_metric_and_the_log(tiny_model_dir: Path) -> None:
    prepared = resolve_engine(EngineArgs.from_options(model=str(tiny_model_dir), quantization="int4",
                                                      int4_activations="float"))  # fmt: skip
    assert prepared.quantization == "int4"
    assert prepared.quantization_scheme == f"int4-g{DEFAULT_INT4_GROUP_SIZE}-mse-mixed"
    assert "int8: qkv_proj of layers 0-1" in prepared.quantization_detail
    uniform = QuantizationConfig("int4", int4_policy="uniform", int4_fit="minmax")
    assert uniform.scheme == f"int4-g{DEFAULT_INT4_GROUP_SIZE}-minmax-uniform"
    assert resolve_engine(EngineArgs.from_options(model=str(tiny_model_dir))).quantization_scheme == "none"
    metrics = ServingMetrics("tiny")
    metrics.set_quantization(prepared.quantization, prepared.quantization_scheme)
    rendered = metrics.render().decode()
    scheme = prepared.quantization_scheme
    assert f'hpi:quantization_info{{method="int4",model_name="tiny",scheme="{scheme}"}} 1.0' in rendered


def test_mixed_policy_keeps_qkv_at_int8(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, dtype="float32", quantization="int4", kv_cache_memory_bytes=1 << 20, max_model_len=64,
              enforce_eager=True)  # fmt: skip
    layers = llm.engine.executor.model.model.layers
    assert {layer.self_attn.qkv_proj.method for layer in layers} == {"int8"}
    assert {layer.mlp.gate_up_proj.method for layer in layers} == {layer.mlp.down_proj.method for layer in layers} == {
        "int4"
    }  # fmt: skip
    assert layer_method("int4", "uniform", "model.layers.1.self_attn.qkv_proj", 30) == "int4"
    assert layer_method("int8", "mixed", "model.layers.1.mlp.down_proj", 30) == "int8"  # policies are int4's


def test_policy_rules_pick_layers_by_position() -> None:
    rules = {"all": [True] * 30, "edges": [i < 4 or i >= 26 for i in range(30)]}
    rules["more_bits"] = [edge or (i - 4) % 3 == 2 for i, edge in enumerate(rules["edges"])]
    for rule, expected in rules.items():
        assert [_RULES[rule](i, 30) for i in range(30)] == expected, rule
    assert describe_policy("uniform", 30) == "all linears int4"
    assert describe_policy("mixed", 30) == "int8: qkv_proj of layers 0-29"


_A8 = {  # per weight format: its tile, its cached measurement, the variable that sets it, its scheme without x in int8
    "int4": (int4_a8_tile, int4_a8_max_rows, "HPI_CPU_INT4_A8_MAX_ROWS", f"int4-g{DEFAULT_INT4_GROUP_SIZE}-mse-mixed"),
    "int8": (int8_a8_tile, int8_a8_max_rows, "HPI_CPU_INT8_A8_MAX_ROWS", "int8"),
}


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_activations_resolve_per_cpu_and_name_the_scheme(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                         method: str) -> None:  # fmt: skip
    """auto is W4A8 (W8A8) exactly where the tile has integer dot products (not plain loops), up to the row count
    measured (here set by HPI_CPU_INT4_A8_MAX_ROWS / HPI_CPU_INT8_A8_MAX_ROWS); the resolved choice is in the scheme
    label (and so in the metric and the compile cache key) and reaches that format's layers, not the other's."""
    tile, measured, variable, base = _A8[method]
    other = "int8" if method == "int4" else "int4"

    def scheme(**options) -> str:
        options = {"quantization": method, **options}
        return resolve_engine(EngineArgs.from_options(model=str(tiny_model_dir), **options)).quantization_scheme

    integer_tile = tile() != "portable"
    setting = f"{method}_activations"
    try:
        for rows, label in ((-1, "-a8"), (12, "-a8upto12"), (0, "")):
            measured.cache_clear()
            monkeypatch.setenv(variable, str(rows))
            assert scheme() == base + (label if integer_tile else "")
            assert scheme(**{setting: "int8"}) == base + "-a8"  # every row count
        monkeypatch.setenv(variable, "2")
        measured.cache_clear()
        llm = LLM(tiny_model_dir, dtype="float32", quantization=method, kv_cache_memory_bytes=1 << 20,
                  max_model_len=64)  # fmt: skip
        if integer_tile:
            assert f"W{method[3]}A8) up to 2 rows" in llm.bundle.resolved.quantization_detail
            down_proj = llm.engine.executor.model.model.layers[0].mlp.down_proj
            assert down_proj.a8_max_rows == 2 and "int8 activations up to 2 rows" in repr(down_proj)
        outs = llm.generate(["hello world", "a b c"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert [len(out.output_token_ids) for out in outs] == [8, 8]
        llm.shutdown()
    finally:
        measured.cache_clear()
    assert scheme(**{setting: "float"}) == base
    # int8's setting reaches int4's int8 layers (its mixed policy's q/k/v) when it says int8; int4's never reaches int8
    both = "-a8-int8-a8" if method == "int4" else "-a8"
    assert scheme(**{setting: "int8", f"{other}_activations": "int8"}) == base + both
    assert scheme(**{f"{other}_activations": "int8", setting: "float"}) == base + both.removeprefix("-a8")
    assert scheme(**{f"{other}_activations": "auto", setting: "float"}) == base
    detail = resolve_engine(EngineArgs.from_options(model=str(tiny_model_dir), quantization=method,
                                                    **{setting: "int8"})).quantization_detail  # fmt: skip
    assert f"W{method[3]}A8" in detail and f"W{other[3]}A8" not in detail
    with pytest.raises(ValueError, match="runs on CPU only"):
        a8_rows(method, "int8", "cuda", torch.bfloat16)
    assert a8_rows(method, "auto", "cuda", torch.bfloat16) == 0
    assert a8_rows(method, "auto", "cpu", torch.float16) == 0  # fp16 x runs torch's ops, which have no W4A8 / W8A8
    with pytest.raises(ValueError, match=f"{method}_a8_max_rows must be -1"):
        QuantizationConfig(method, **{f"{method}_a8_max_rows": -3})
    with pytest.raises(ValueError, match=f"{setting} must be one of"):
        QuantizationConfig(method, **{setting: "int4"})


@pytest.mark.parametrize("int8_activations", ["auto", "int8"])
def test_int4_int8_q_k_v_keep_float_activations_unless_asked(tiny_model_dir: Path, int8_activations: str) -> None:
    """int4's mixed policy keeps q/k/v at int8 weights and, by default, float x (the layers rounding hurts most):
    int8_activations' auto does not reach them, its int8 does (W8A8, named in the scheme)."""
    llm = LLM(tiny_model_dir, dtype="float32", quantization="int4", int4_activations="int8",
              int8_activations=int8_activations, kv_cache_memory_bytes=1 << 20, max_model_len=64)  # fmt: skip
    asked = int8_activations == "int8"
    suffix = "-int8-a8" if asked else ""
    assert llm.bundle.resolved.quantization_scheme == f"int4-g{DEFAULT_INT4_GROUP_SIZE}-mse-mixed-a8{suffix}"
    layer = llm.engine.executor.model.model.layers[0]
    assert layer.mlp.down_proj.int8_activations and layer.self_attn.qkv_proj.int8_activations == asked
    assert layer.self_attn.qkv_proj.method == "int8" and layer.self_attn.o_proj.method == "int4"
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 8
    llm.shutdown()


def test_the_int8_head_follows_its_own_activations_setting(tiny_model_dir: Path) -> None:
    """A quantized LM head follows lm_head_activations, not int8_activations (float here: its logits are
    int8_logits), while the int8 linears take W8A8."""
    llm = LLM(tiny_model_dir, dtype="float32", quantization="int8", int8_activations="int8", quantize_lm_head=True,
              lm_head_activations="float", kv_cache_memory_bytes=1 << 20, max_model_len=64)  # fmt: skip
    model = llm.engine.executor.model
    assert model.model.layers[0].self_attn.qkv_proj.int8_activations
    assert "int8 activations" in repr(model.model.layers[0].self_attn.qkv_proj)
    assert not model.lm_head.int8_activations
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 8
    llm.shutdown()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_an_int8_lm_head_takes_int8_activations_by_its_own_setting(
    tiny_model_dir: Path, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm_head_activations: "int8" makes a quantized int8 head (the tiny model's is tied, so int4 quantizes it to
    int8 too) take x in int8 with its leading logits recomputed from float x, whatever the other linears do; greedy
    tokens are the float-x head's. "auto" follows the W8A8 tile and the row count measured (set here), and the
    detail says so; without --quantize-lm-head the setting changes nothing. Bad values are a ValueError."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["hello world", "a b c", "the tokenizer", "once upon"]
    tokens = {}
    for setting in ("float", "int8"):
        llm = LLM(tiny_model_dir, dtype="float32", quantization=method, quantize_lm_head=True,
                  lm_head_activations=setting, kv_cache_memory_bytes=1 << 20, max_model_len=64)  # fmt: skip
        head = llm.engine.executor.model.lm_head
        assert head.method == "int8" and head.int8_activations == (setting == "int8")
        assert ("int8 LM head (W8A8)" in llm.bundle.resolved.quantization_detail) == (setting == "int8")
        tokens[setting] = [out.output_token_ids for out in llm.generate(prompts, greedy)]
        llm.shutdown()
    assert tokens["int8"] == tokens["float"]

    def resolved(**options):
        return resolve_engine(EngineArgs.from_options(model=str(tiny_model_dir), quantization=method, **options))

    monkeypatch.setenv("HPI_CPU_INT8_A8_MAX_ROWS", "6")
    int8_a8_max_rows.cache_clear()
    try:
        config = resolved(quantize_lm_head=True).executor_config.quantization
        if int8_a8_tile() != "portable":
            assert (config.lm_head_activations, config.lm_head_a8_max_rows) == ("int8", 6)
            assert "int8 LM head (W8A8), each row's leading logits recomputed from float x up to 6 rows" in (
                resolved(quantize_lm_head=True).quantization_detail)
        else:
            assert config.lm_head_activations == "float"
        no_head = resolved(lm_head_activations="int8").executor_config.quantization
        assert no_head.lm_head_activations == "float"
    finally:
        int8_a8_max_rows.cache_clear()
    with pytest.raises(ValueError, match="lm_head_activations must be one of"):
        QuantizationConfig(method, lm_head_activations="int4")
    on_gpu = ResolvedQuantization(QuantizationConfig(method, quantize_lm_head=True, lm_head_activations="int8",
                                                     **{f"{method}_activations": "float"}), method, method, method)
    with pytest.raises(ValueError, match=r"lm_head_activations int8 \(W8A8\) runs on CPU only, not cuda"):
        resolve_activations(on_gpu, torch.device("cuda"), torch.bfloat16, tied_lm_head=True)
