"""Reading model directories: config fields, RoPE in either place, EOS ids, and clear refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.loader import safetensors_files
from hpi_runtime.models.registry import SUPPORTED_ARCHITECTURES


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_reads_shapes_eos_and_rope_parameters(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads) == (
        "LlamaForCausalLM",
        2,
        4,
        2,
    )
    assert config.head_dim == 16 and config.tie_word_embeddings
    assert config.rope.rope_type == "default" and config.rope.theta == 10000.0
    tokenizer_config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert config.eos_token_ids == frozenset({2})  # <|im_end|> from generation_config.json
    assert config.kv_bytes_per_token(4) == 2 * 2 * 2 * 16 * 4


def test_rope_theta_top_level_and_llama3_scaling(tiny_model_dir: Path, tmp_path: Path) -> None:
    old_style = _copy_with_config(tiny_model_dir, tmp_path / "old", rope_parameters=None, rope_theta=123.0)
    assert load_model_config(old_style).rope.theta == 123.0
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = load_model_config(_copy_with_config(tiny_model_dir, tmp_path / "l3", rope_parameters=llama3)).rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings) == (
        "llama3",
        5e5,
        32.0,
        8192,
    )
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported RoPE type 'yarn'"):
        load_model_config(_copy_with_config(tiny_model_dir, tmp_path / "yarn", rope_parameters=yarn))


def test_generation_config_eos_list_and_sampling_defaults(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_with_config(tiny_model_dir, tmp_path / "m")
    (model_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.9, "do_sample": True})
    )
    config = load_model_config(model_dir)
    assert config.eos_token_ids == frozenset({0, 2})
    assert config.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}


def test_refuses_unknown_architecture_and_remote_code(tiny_model_dir: Path, tmp_path: Path) -> None:
    unknown = _copy_with_config(tiny_model_dir, tmp_path / "u", architectures=["MambaForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'") as refused:
        load_model_config(unknown)
    assert all(arch in str(refused.value) for arch in SUPPORTED_ARCHITECTURES)  # names what does work
    remote = _copy_with_config(tiny_model_dir, tmp_path / "r", auto_map={"AutoModelForCausalLM": "x.Model"})
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model_config(remote)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model_config(tmp_path)


def test_gemma3_config_before_transformers_5_and_phi3_su_scaling(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Gemma 3 as transformers 4 saved it: no layer_types, a sliding_window_pattern, rope_local_base_freq.
    gemma3 = _copy_with_config(
        tiny_model_dir, tmp_path / "g3", architectures=["Gemma3ForCausalLM"], rope_parameters=None,
        rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=512, sliding_window_pattern=2,
        query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        attn_logit_softcapping=50.0,
    )  # fmt: skip
    config = load_model_config(gemma3)
    assert config.layer_sliding_windows == (512, None)
    assert (config.rope.theta, config.sliding_rope.theta, config.layer_rope(0).theta) == (1e6, 1e4, 1e4)
    assert config.attention_scale == 256**-0.5 and config.attn_logit_softcap is None and config.qk_norm
    gemma2 = _copy_with_config(tiny_model_dir, tmp_path / "g2", architectures=["Gemma2ForCausalLM"],
                               sliding_window=64, attn_logit_softcapping=50.0)  # fmt: skip
    assert load_model_config(gemma2).layer_sliding_windows == (64, None)  # alternating from layer 0
    assert load_model_config(gemma2).attn_logit_softcap == 50.0
    su = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi3 = _copy_with_config(tiny_model_dir, tmp_path / "phi3", architectures=["Phi3ForCausalLM"],
                             rope_parameters=None, rope_scaling=su, original_max_position_embeddings=128)  # fmt: skip
    rope = load_model_config(phi3).rope
    assert (rope.rope_type, rope.original_max_position_embeddings, rope.factor) == ("longrope", 128, 4.0)
    bidirectional = _copy_with_config(gemma2, tmp_path / "bi", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="bidirectional"):
        load_model_config(bidirectional)


def test_missing_or_pickle_only_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy_with_config(tiny_model_dir, tmp_path / "m")
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors .*pytorch_model\.bin.*pickle"):
        safetensors_files(model_dir)
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="missing: model-00001-of-00002.safetensors"):
        safetensors_files(model_dir)
