"""Checking adapter directories before anything loads: each bad directory is a ValueError naming the problem;
--lora-modules values in both of vLLM's forms; the lora config section's rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hpi_runtime.config import EngineArgs, LoRAConfig
from hpi_runtime.lora.peft_dir import read_adapter
from hpi_runtime.lora.registry import LoRAAlreadyLoadedError, LoRARegistry
from hpi_runtime.lora.request import LoRAModulePath, parse_lora_module
from hpi_runtime.models.config import load_model_config

PREFIX = "base_model.model.model.layers"


def _write(directory: Path, tensors: dict[str, tuple[int, int]], **config) -> Path:
    """An adapter in PEFT's exact file format with these tensor shapes (values are irrelevant here)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file({name: torch.ones(shape) for name, shape in tensors.items()}, directory / "adapter_model.safetensors")
    return directory


def _q_proj(layer: int = 0, rank: int = 4, out: int = 64, inp: int = 64) -> dict[str, tuple[int, int]]:
    return {f"{PREFIX}.{layer}.self_attn.q_proj.lora_A.weight": (rank, inp),
            f"{PREFIX}.{layer}.self_attn.q_proj.lora_B.weight": (out, rank)}  # fmt: skip


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return load_model_config(tiny_model_dir)  # hidden 64, 4 q heads and 2 kv heads of 16, 2 layers


def test_a_good_adapter_is_read(config, tmp_path):
    spec = read_adapter(_write(tmp_path / "ok", _q_proj()), config, max_lora_rank=8)
    assert (
        spec.rank == 4
        and spec.scaling == 2.0
        and [(t.layer, t.module) for t in spec.targets] == [(0, "self_attn.q_proj")]
    )
    rs = read_adapter(_write(tmp_path / "rs", _q_proj(), use_rslora=True), config, max_lora_rank=8)
    assert rs.scaling == 4.0  # alpha / sqrt(r)


@pytest.mark.parametrize(
    ("tensors", "extra", "message"),
    [
        (_q_proj(rank=16), {"r": 16}, "rank 16 is greater than max_lora_rank 8"),
        (_q_proj(out=32), {}, "do not fit the base model"),
        (_q_proj(layer=2), {}, "the base model has 2 layers"),
        ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": (4, 64)}, {}, "lora_A and lora_B must both be present"),
        (
            {
                f"{PREFIX}.0.self_attn.rotary.lora_A.weight": (4, 64),
                f"{PREFIX}.0.self_attn.rotary.lora_B.weight": (64, 4),
            },
            {},
            "unknown target module",
        ),  # fmt: skip
        ({"base_model.model.lm_head.lora_A.weight": (4, 64)}, {}, "unexpected tensor"),
        (_q_proj(), {"use_dora": True}, "DoRA"),
        (_q_proj(), {"bias": "all"}, "trained biases"),
    ],
)
def test_bad_adapters_are_refused(config, tmp_path, tensors, extra, message):
    with pytest.raises(ValueError, match=message):
        read_adapter(_write(tmp_path / "bad", tensors, **extra), config, max_lora_rank=8)


def test_missing_files_are_refused(config, tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        read_adapter(tmp_path / "nowhere", config, 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter(tmp_path / "empty", config, 8)
    no_weights = _write(tmp_path / "no-weights", _q_proj())
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        read_adapter(no_weights, config, 8)


def test_moe_expert_targets_are_refused(tiny_model_factory, tmp_path):
    moe_dir = tiny_model_factory("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32)  # fmt: skip
    moe = load_model_config(moe_dir)
    experts = {f"{PREFIX}.0.mlp.experts.1.gate_proj.lora_A.weight": (4, 64),
               f"{PREFIX}.0.mlp.experts.1.gate_proj.lora_B.weight": (32, 4)}  # fmt: skip
    with pytest.raises(ValueError, match="MoE experts"):
        read_adapter(_write(tmp_path / "experts", experts), moe, 8)
    dense_name = {f"{PREFIX}.0.mlp.gate_proj.lora_A.weight": (4, 64), f"{PREFIX}.0.mlp.gate_proj.lora_B.weight": (
        128, 4)}  # fmt: skip
    with pytest.raises(ValueError, match="no dense mlp.gate_proj"):
        read_adapter(_write(tmp_path / "dense", dense_name), moe, 8)
    assert read_adapter(_write(tmp_path / "attn", _q_proj()), moe, 8).rank == 4  # attention is fine


def test_registry_refuses_without_changing_what_is_loaded(config, tmp_path):
    registry = LoRARegistry(config, max_lora_rank=8)
    good = registry.load("good", str(_write(tmp_path / "good", _q_proj())))
    with pytest.raises(LoRAAlreadyLoadedError, match="The lora adapter 'good' has already been loaded."):
        registry.load("good", str(tmp_path / "good"))
    with pytest.raises(ValueError):
        registry.load("bad", str(_write(tmp_path / "bad", _q_proj(rank=16), r=16)))
    assert registry.names() == ["good"] and registry.get("good") == good
    registry.unload("good")
    again = registry.load("good", str(tmp_path / "good"))
    assert again.lora_int_id != good.lora_int_id  # new weights may sit behind the name: new cache keys


def test_lora_modules_in_both_forms_and_the_config_rules():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("x", "/p", "m")
    for bad in ("nameonly", "=path", '{"name": "x"}', "{broken"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    args = EngineArgs.from_options(enable_lora=True, lora_modules=["a=/x", "b=/y"], max_loras=2)
    assert args.lora.lora_modules == ("a=/x", "b=/y") and args.lora.num_cpu_loras == 2
    with pytest.raises(ValueError, match="needs enable_lora"):
        LoRAConfig(lora_modules=("a=/x",))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="twice"):
        LoRAConfig(enable_lora=True, lora_modules=("a=/x", "a=/y"))


def test_lora_modules_round_trip_through_the_operator_flag_contract():
    """The operator renders --lora-modules through hpi_contracts (type 'strs'); `hpi serve` parses it back."""
    from hpi_contracts.serve import serve_args
    from hpi_runtime.cli import build_parser

    modules = ["a=/cache/a", '{"name": "b", "path": "/cache/b"}']
    argv = serve_args({"--enable-lora": True, "--lora-modules": modules, "--max-loras": 2})
    assert argv == ["--enable-lora", "--lora-modules", *modules, "--max-loras", "2"]
    parsed = build_parser().parse_args(["serve", *argv])
    assert EngineArgs.from_options(enable_lora=parsed.enable_lora, lora_modules=parsed.lora_modules).lora.modules == (
        LoRAModulePath("a", "/cache/a"), LoRAModulePath("b", "/cache/b"))  # fmt: skip


def test_lora_modules_from_a_file_as_the_operator_mounts_it(tmp_path):
    """`--lora-modules @PATH`: the pool's list from the operator's ConfigMap; missing or empty lists nothing."""
    listing = tmp_path / "lora-modules.json"
    listing.write_text(json.dumps([{"name": "sql", "path": "/cache/sql", "base_model_name": "m"},
                                   {"name": "chat", "path": "/cache/chat"}]))  # fmt: skip
    config = LoRAConfig(enable_lora=True, lora_modules=(f"@{listing}", "extra=/x"))
    assert config.modules == (LoRAModulePath("sql", "/cache/sql", "m"), LoRAModulePath("chat", "/cache/chat"),
                              LoRAModulePath("extra", "/x"))  # fmt: skip
    assert LoRAConfig(enable_lora=True, lora_modules=(f"@{tmp_path / 'absent.json'}",)).modules == ()
    (tmp_path / "empty.json").write_text("")
    assert LoRAConfig(enable_lora=True, lora_modules=(f"@{tmp_path / 'empty.json'}",)).modules == ()
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="expected a JSON list of objects"):
        LoRAConfig(enable_lora=True, lora_modules=(f"@{tmp_path / 'bad.json'}",))
    listing.write_text(json.dumps([{"name": "sql", "path": "/a"}, {"name": "sql", "path": "/b"}]))
    with pytest.raises(ValueError, match="twice"):
        LoRAConfig(enable_lora=True, lora_modules=(f"@{listing}",))
