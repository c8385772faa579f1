"""Load a model from safetensors: memory-mapped, shard by shard, each tensor through its parameter's loader.

Only safetensors is read (never pickle). Shards are the files `model.safetensors.index.json` lists when
present, else the `model*.safetensors` files, else every `*.safetensors` file in the directory. A Hub
download fetches by the first two rules (`weight_file_patterns`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from hpi_runtime.model.attention import AttentionBackend
from hpi_runtime.model.config import ModelConfig
from hpi_runtime.model.linear import default_weight_loader
from hpi_runtime.model.llama import MODEL_CLASSES, LlamaForCausalLM
from hpi_runtime.model.parallel import SINGLE, TensorParallel

INDEX_FILE = "model.safetensors.index.json"
# Hugging Face's single-file and unindexed names; repos such as Mistral's also ship consolidated.safetensors,
# the same weights in another naming, which must be neither downloaded nor loaded.
UNINDEXED_WEIGHTS_PATTERN = "model*.safetensors"
PROGRESS_MIN_BYTES = 1 << 30  # show a progress bar only for checkpoints of 1 GiB or more
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_file_patterns(index: dict | None) -> list[str]:
    """Which weight files to fetch from a Hub repo, given its parsed index (None when it has none): the
    shards the index's weight_map lists, else `model*.safetensors`."""
    if index is None:
        return [UNINDEXED_WEIGHTS_PATTERN]
    shards = sorted(set(index.get("weight_map", {}).values()))
    if not shards:
        raise ValueError(f"{INDEX_FILE} has an empty weight_map: no shard to fetch")
    return shards


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shard files, in order; FileNotFoundError if there are none or some are missing."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shards that are missing: {', '.join(missing)}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        # A checkpoint saved under another name alone still loads; beside model*.safetensors it is a copy.
        preferred = [f for f in files if fnmatch(f.name, UNINDEXED_WEIGHTS_PATTERN)]
        files = preferred or files
    if not files:
        pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are not loaded, convert them)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def tensor_data_bytes(path: Path) -> int:
    """Bytes of tensor data in one safetensors file: the file less its 8-byte length prefix and JSON header
    (safetensors refuses files whose data region holds anything but the tensors)."""
    with path.open("rb") as f:
        header_bytes = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header_bytes


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard; tensors are memory-mapped views until copied."""
    # Progress counts tensor bytes, so its total must too: file sizes include the headers.
    total_bytes = sum(tensor_data_bytes(f) for f in files)
    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="loading weights", disable=total_bytes < PROGRESS_MIN_BYTES
    ) as progress:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as shard:
                for name in shard.keys():
                    tensor = shard.get_tensor(name)
                    yield name, tensor
                    progress.update(tensor.numel() * tensor.element_size())


def load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into its parameter; ValueError on unknown or missing tensors."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(files):
        if name.endswith(_SKIPPED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # some tied checkpoints still store a copy
        target, shard_id = name, None
        for checkpoint_part, (param_part, shard) in model.packed_modules_mapping.items():
            if f".{checkpoint_part}." in name:
                target, shard_id = name.replace(checkpoint_part, param_part), shard
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {model.config.architecture}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        loaded.add(f"{target}:{shard_id}")
    expected: set[str] = set()
    for n in params:
        shards = [s for p, s in model.packed_modules_mapping.values() if f".{p}." in n]
        expected.update(f"{n}:{s}" for s in shards or [None])
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    tp: TensorParallel = SINGLE,
) -> LlamaForCausalLM:
    """Build this rank's part of the model for `config` directly in `dtype` on `device` and fill it from the
    (unsharded) checkpoint."""
    files = safetensors_files(config.model_dir)
    with _default_dtype(dtype), torch.device(device):
        model = MODEL_CLASSES[config.architecture](config, backend, tp)
    load_weights(model, files)
    return model.eval()


def checkpoint_num_params(config: ModelConfig) -> int:
    """Parameters stored in the checkpoint, read from the safetensors headers only."""
    total = 0
    for path in safetensors_files(config.model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                total += math.prod(shard.get_slice(name).get_shape())
    return total


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the parameters (a tied matrix counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
