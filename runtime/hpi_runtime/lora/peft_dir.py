"""Read and check a PEFT LoRA adapter directory against the base model, without loading its tensors.

A directory holds adapter_config.json (r, lora_alpha, use_rslora, target_modules) and adapter_model.safetensors
with, per adapted projection, `...model.layers.N.<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r].
The runtime adapts the attention and MLP projections of every dense layer: q/k/v/o_proj and gate/up/down_proj,
or a fused qkv_proj / gate_up_proj (Phi-3's names). Anything else is refused with the reason, before a byte of
it is loaded: other modules (embeddings, LM head), MoE experts (LoRA on routed or shared experts is not
supported), DoRA, trained biases, per-module rank or alpha patterns, a rank above --max-lora-rank, shapes that
do not fit the base model. Only the safetensors header is read here (no torch): the API server checks a
directory this way before it tells the engine to load it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from hpi_runtime.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
# checkpoint module -> the runtime's projection (attribute path inside a decoder layer), its parts
ATTENTION_MODULES = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "qkv_proj": ("q", "k", "v"),
                     "o_proj": ("o",)}  # fmt: skip
MLP_MODULES = {"gate_proj": ("gate",), "up_proj": ("up",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
_MOE_WORDS = ("experts", "shared_expert", "block_sparse_moe")


@dataclass(frozen=True)
class AdapterTarget:
    """One adapted checkpoint module of one layer: which parts of the runtime's projection it feeds."""

    layer: int
    module: str  # e.g. "self_attn.q_proj"
    parts: tuple[str, ...]  # ("q",), or ("q", "k", "v") for a fused qkv_proj


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: what to load and how to scale it."""

    path: Path
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    targets: tuple[AdapterTarget, ...]
    base_model_name: str | None  # adapter_config.json's base_model_name_or_path, for information


def part_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """The unsharded (out, in) of every projection part of `layer` that a LoRA may adapt."""
    d, hidden = config.head_dim, config.hidden_size
    shapes = {"q": (config.num_heads * d, hidden), "k": (config.num_kv_heads * d, hidden),
              "v": (config.num_kv_heads * d, hidden), "o": (hidden, config.num_heads * d)}  # fmt: skip
    if config.moe is None or layer in config.moe.dense_layer_ids:
        inter = config.intermediate_size
        shapes.update(gate=(inter, hidden), up=(inter, hidden), down=(hidden, inter))
    return shapes


def read_safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the file's JSON header alone. ValueError for a file that is not safetensors."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2**20:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{directory} is not a PEFT adapter directory: it has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type {config['peft_type']!r} is not LORA")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "modules_to_save": "adapters that also train whole modules (modules_to_save) are not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise ValueError(f"{path}: {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: adapters with trained biases (bias={config['bias']!r}) are not supported")
    return config


def _target(config: ModelConfig, layer: int, module: str, key: str) -> AdapterTarget:
    if layer >= config.num_layers:
        raise ValueError(f"{key}: layer {layer}, but the base model has {config.num_layers} layers")
    if any(word in module.split(".") for word in _MOE_WORDS):
        raise ValueError(f"{key}: the adapter targets MoE experts ({module}); LoRA on experts is not supported "
                         "(attention and dense MLP projections are)")  # fmt: skip
    group, _, name = module.rpartition(".")
    table = ATTENTION_MODULES if group == "self_attn" else MLP_MODULES if group == "mlp" else {}
    if name not in table:
        raise ValueError(f"{key}: unknown target module {module!r}; supported: self_attn.q/k/v/o_proj (or qkv_proj) "
                         "and mlp.gate/up/down_proj (or gate_up_proj)")  # fmt: skip
    parts = table[name]
    if any(part not in part_shapes(config, layer) for part in parts):
        raise ValueError(f"{key}: layer {layer} of the base model has no dense {module} (a MoE layer): LoRA on "
                         "experts is not supported")  # fmt: skip
    return AdapterTarget(layer, module, parts)


def read_adapter(path: str | Path, config: ModelConfig, max_lora_rank: int) -> AdapterSpec:
    """Check the adapter directory at `path` against the base model; ValueError says what does not fit."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter path {str(path)!r} is not a directory")
    raw = _read_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"{directory} has no {WEIGHTS_FILE} (only safetensors adapters are loaded)")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{directory / CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank} (--max-lora-rank)")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"{directory / CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    shapes = read_safetensors_header(weights)
    found: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        match = ADAPTER_KEY.match(key)
        if match is None:
            raise ValueError(f"{weights.name}: unexpected tensor {key!r} (not a lora_A/lora_B of a decoder layer's "
                             "projection: embeddings, the LM head and other modules are not supported)")  # fmt: skip
        found.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = shape
    if not found:
        raise ValueError(f"{weights} holds no LoRA tensors")
    targets = []
    for (layer, module), pair in sorted(found.items()):
        key = f"model.layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{key}: lora_A and lora_B must both be present")
        target = _target(config, layer, module, key)
        parts = part_shapes(config, layer)
        out_features = sum(parts[p][0] for p in target.parts)
        in_features = parts[target.parts[0]][1]
        if pair["A"] != (rank, in_features) or pair["B"] != (out_features, rank):
            raise ValueError(
                f"{key}: lora_A {list(pair['A'])} and lora_B {list(pair['B'])} do not fit the base "
                f"model, which needs [{rank}, {in_features}] and [{out_features}, {rank}] (rank {rank})"
            )
        targets.append(target)
    return AdapterSpec(directory, rank, float(scaling), tuple(targets), raw.get("base_model_name_or_path"))
