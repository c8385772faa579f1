"""Load a model from safetensors: memory-mapped, shard by shard, each tensor through its parameter's loader.

Only safetensors is read (never pickle). Shards are the files `model.safetensors.index.json` lists when
present, else the `model*.safetensors` files, else every `*.safetensors` file in the directory. A Hub
download fetches by the first two rules (`weight_file_patterns`).

Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors; config.json's `quantization_config`, see
quantization/checkpoint.py) are built on the meta device, each quantized linear is read and repacked straight into
a `QuantizedLinear` (integer codes in, our int4/int8 layout out), and only the remaining float tensors
(embeddings, norms, unquantized linears) get real storage: no float copy of a quantized weight exists.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from fnmatch import fnmatch
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from hpi_kernels.quant import pack_int4
from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.models.config import ModelConfig
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.linear import LinearBase, default_weight_loader
from hpi_runtime.models.parallel import SINGLE, SINGLE_STAGE, PipelineStage, TensorParallel
from hpi_runtime.models.registry import model_class
from hpi_runtime.models.rotary import RotaryEmbedding
from hpi_runtime.quantization.checkpoint import (
    QUANTIZED_MARKERS,
    READERS,
    CheckpointQuantization,
    RepackedLinear,
    read_checkpoint_quantization,
)
from hpi_runtime.quantization.linear import QuantizedLinear, QuantizedWeight

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


def iter_checkpoint(files: list[Path], skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard but those in `skip`; tensors are memory-mapped views
    until copied."""
    # Progress counts tensor bytes, so its total must too: file sizes include the headers.
    total_bytes = sum(tensor_data_bytes(f) for f in files)
    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, desc="loading weights", disable=total_bytes < PROGRESS_MIN_BYTES
    ) as progress:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as shard:
                for name in shard.keys():
                    if name in skip:
                        continue
                    tensor = shard.get_tensor(name)
                    yield name, tensor
                    progress.update(tensor.numel() * tensor.element_size())


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _held_by_another_stage(stage: PipelineStage, name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to a part of the model another pipeline stage holds: a layer
    outside this stage, the embedding off the first stage, the LM head off the last."""
    if stage.size == 1:
        return False
    if match := _LAYER_INDEX.match(name):
        return not stage.owns_layer(int(match.group(1)))
    return name.startswith(("model.embed_tokens.", "lm_head."))


def _checkpoint_target(model: DecoderForCausalLM, name: str) -> tuple[str, str, str | int | None] | None:
    """(the model's name for checkpoint tensor `name`, the parameter it loads into, the shard of a merged
    parameter or None), or None for a tensor the model never takes (a tied model's stored LM head copy)."""
    if name.endswith(_SKIPPED_SUFFIXES):
        return None
    name = model.checkpoint_name(name)
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return None  # some tied checkpoints still store a copy
    packed = () if name.startswith(model.unpacked_prefixes) else model.packed_modules_mapping.items()
    for checkpoint_part, (param_part, shard) in packed:
        if f".{checkpoint_part}." in name:
            return name, name.replace(checkpoint_part, param_part), shard
    return name, name, None


def _load_tensor(param: torch.Tensor, tensor: torch.Tensor, shard_id: str | int | None) -> None:
    loader = getattr(param, "weight_loader", default_weight_loader)
    with torch.no_grad():
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)


def _expected_tensors(model: DecoderForCausalLM, params: Iterable[str]) -> set[str]:
    """"param:shard" for every checkpoint tensor the parameters `params` need."""
    expected: set[str] = set()
    for n in params:
        shards = [] if n.startswith(model.unpacked_prefixes) else [
            s for p, s in model.packed_modules_mapping.values() if f".{p}." in n
        ]
        expected.update(f"{n}:{s}" for s in shards or [None])
    return expected


def _check_complete(expected: set[str], loaded: set[str]) -> None:
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def load_weights(model: DecoderForCausalLM, files: list[Path], already_loaded: frozenset[str] = frozenset()) -> None:
    """Copy every checkpoint tensor into its parameter; ValueError on unknown or missing tensors. Tensors
    named in `already_loaded` (a pre-quantized checkpoint's linears) and QuantizedLinear modules are skipped."""
    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    params = {n: p for n, p in model.named_parameters() if n.rpartition(".")[0] not in quantized}
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(files, already_loaded):
        mapped = _checkpoint_target(model, name)
        if mapped is None:
            continue
        name, target, shard_id = mapped
        param = params.get(target)
        if param is None and _held_by_another_stage(model.stage, name):
            continue
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {model.config.architecture}")
        _load_tensor(param, tensor, shard_id)
        loaded.add(f"{target}:{shard_id}")
    _check_complete(_expected_tensors(model, params), loaded)


_LAYER_PREFIX = re.compile(r"^(.*?\blayers\.\d+)\.")


def _group_of(param_name: str) -> str | None:
    """The decoder layer ("model.layers.3") a parameter belongs to, or None for the rest of the model."""
    match = _LAYER_PREFIX.match(param_name)
    return match.group(1) if match else None


def _load_layer_by_layer(model: DecoderForCausalLM, files: list[Path], where: tuple[torch.dtype, torch.device],
                         after_layer: Callable[[DecoderForCausalLM, str | None], None]) -> None:  # fmt: skip
    """Fill a model built with its parameters on the meta device one decoder layer at a time: each layer's
    parameters get storage, its tensors are read from the checkpoint, then `after_layer(model, "model.layers.<i>")`
    runs (the executor's quantization and CPU packing, which replace the float weights); the rest of the model
    (embeddings, norms, LM head, a vision tower) last, then `after_layer(model, None)`. Peak memory: the model as
    `after_layer` leaves it plus one float layer, instead of the whole float model (bench/results/quantization.md,
    "Peak memory at load")."""
    dtype, device = where
    params = dict(model.named_parameters())
    members: dict[str | None, list[str]] = {}
    for n in params:  # the model's order: layer by layer, the rest last
        members.setdefault(_group_of(n), []).append(n)
    members[None] = members.pop(None, [])
    groups: dict[str | None, list[tuple[str, str, str | int | None]]] = {g: [] for g in members}
    with _open_checkpoint(files) as (get, names, _):
        for name in sorted(names):
            mapped = _checkpoint_target(model, name)
            if mapped is None:
                continue
            model_name, target, shard_id = mapped
            if target not in params:
                if _held_by_another_stage(model.stage, model_name):
                    continue
                raise ValueError(f"checkpoint tensor {model_name!r} has no matching parameter in "
                                 f"{model.config.architecture}")  # fmt: skip
            groups[_group_of(target)].append((name, target, shard_id))
        for group, tensors in groups.items():
            _materialize(model if group is None else model.get_submodule(group), model.config, dtype, device)
            loaded: set[str] = set()
            for name, target, shard_id in tensors:
                _load_tensor(model.get_parameter(target), get(name), shard_id)  # type: ignore[arg-type]
                loaded.add(f"{target}:{shard_id}")
            _check_complete(_expected_tensors(model, members[group]), loaded)
            after_layer(model, group)
            _return_freed_memory()


# glibc keeps the heap pages a freed tensor leaves (a layer's float weights, dropped for its quantized ones) unless
# asked; None where the C library has no malloc_trim (not glibc).
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)


def _return_freed_memory() -> None:
    """Hand freed heap pages back to the OS, so that the resident size after each layer is what is live (the
    embedded model's bf16 load in int8, anonymous memory at its peak: 248-288 MiB without, 168-169 with; the
    float model whole before quantizing: 294)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside keep their parameters on the meta device (no storage; each is freed as it is
    registered) and their buffers where they are computed (rotary tables, a vision tower's frequencies). It patches
    nn.Module for the whole process while it lasts: the loading thread is the only one building modules then."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # weight_loader and the like
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


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
    stage: PipelineStage = SINGLE_STAGE,
    after_layer: Callable[[DecoderForCausalLM, str | None], None] | None = None,
) -> DecoderForCausalLM:
    """Build this rank's part of the model for `config` (its tensor-parallel shard of its pipeline stage's
    layers) directly in `dtype` on `device` and fill it from the (unsharded) checkpoint. With `after_layer` (the
    executor's quantization and CPU packing), layer by layer: _load_layer_by_layer."""
    files = safetensors_files(config.model_dir)
    checkpoint_quantization = read_checkpoint_quantization(config.model_dir)
    if checkpoint_quantization is not None:
        if stage.size > 1:
            raise ValueError(f"pre-quantized ({checkpoint_quantization.scheme}) checkpoints load with "
                             "pipeline_parallel_size 1 only")  # fmt: skip
        return _load_prequantized(config, checkpoint_quantization, (dtype, device), backend, tp, files)
    if after_layer is not None:
        with _default_dtype(dtype), torch.device(device), _parameters_on_meta():
            model = model_class(config.architecture)(config, backend, tp, stage)
        _load_layer_by_layer(model, files, (dtype, torch.device(device)), after_layer)
        return model.eval()
    with _default_dtype(dtype), torch.device(device):
        model = model_class(config.architecture)(config, backend, tp, stage)
    load_weights(model, files)
    return model.eval()


TensorGetter = Callable[[str], "torch.Tensor | None"]


@contextmanager
def _open_checkpoint(files: list[Path]) -> Iterator[tuple[TensorGetter, frozenset[str], set[str]]]:
    """(get(name) -> tensor or None, every tensor name, the names got so far), over all shards."""
    with ExitStack() as stack:
        where = {}
        for path in files:
            shard = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            where.update((name, shard) for name in shard.keys())
        got: set[str] = set()

        def get(name: str) -> torch.Tensor | None:
            shard = where.get(name)
            if shard is None:
                return None
            got.add(name)
            return shard.get_tensor(name)

        yield get, frozenset(where), got


def _merged_weight(
    parts: list[RepackedLinear], quantization: CheckpointQuantization, name: str
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """q/k/v (gate/up) checkpoint linears stacked along N into one weight, as the merged layer holds them."""
    perm = parts[0].perm
    for part in parts[1:]:
        if (part.perm is None) != (perm is None) or (perm is not None and not torch.equal(part.perm, perm)):
            # GPTQ orders a layer's channels by its input's statistics; q/k/v (gate/up) share the input.
            raise ValueError(f"{name}: the merged projections have different act-order permutations (g_idx)")
    codes = torch.cat([p.codes for p in parts])
    scales = torch.cat([p.scales for p in parts])
    if quantization.bits == 8:
        return QuantizedWeight("int8", codes, scales), perm
    zeros = torch.cat([p.zeros for p in parts if p.zeros is not None])
    return QuantizedWeight("int4", pack_int4(codes), scales, zeros, quantization.group_size), perm


def _swap_in_quantized_linears(
    model: DecoderForCausalLM,
    quantization: CheckpointQuantization,
    checkpoint: tuple[TensorGetter, frozenset[str]],  # (get, all tensor names)
    where: tuple[torch.dtype, torch.device],
) -> None:
    (get, names), (dtype, device) = checkpoint, where
    checkpoint_parts: dict[str, list[str]] = {}
    for checkpoint_part, (param_part, _) in model.packed_modules_mapping.items():
        checkpoint_parts.setdefault(param_part, []).append(checkpoint_part)
    markers = QUANTIZED_MARKERS[quantization.method]
    for name, module in list(model.named_modules()):
        if not isinstance(module, LinearBase):
            continue
        parent, _, child = name.rpartition(".")
        prefixes = [f"{parent}.{part}" for part in checkpoint_parts.get(child, [child])]
        quantized = [any(f"{p}.{m}" in names for m in markers) for p in prefixes]
        if not any(quantized):
            continue  # a linear the checkpoint keeps in float (an ignore list): loaded as usual
        if not all(quantized):
            raise ValueError(f"{name}: the checkpoint quantizes some of {prefixes} but not all")
        parts = [READERS[quantization.method](get, p, quantization) for p in prefixes]
        weight, perm = _merged_weight(parts, quantization, name)
        bias = None
        if module.bias is not None:
            biases = [get(f"{p}.bias") for p in prefixes]
            if any(b is None for b in biases):
                raise ValueError(f"{name}: the model has a bias, the checkpoint lacks one of {prefixes}")
            bias = torch.cat(biases)  # type: ignore[arg-type]
        if weight.out_features != module.weight.shape[0] or weight.in_features != module.weight.shape[1]:
            raise ValueError(f"{name}: checkpoint weight is {weight.out_features} x {weight.in_features}, "
                             f"the model expects {tuple(module.weight.shape)}")  # fmt: skip
        setattr(model.get_submodule(parent), child, QuantizedLinear(weight, bias, dtype, device, perm))


def _materialize(model: nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter still on the meta device real (uninitialised) storage, keeping ties and loaders."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            if id(param) not in replaced:
                new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
                if hasattr(param, "weight_loader"):
                    new.weight_loader = param.weight_loader
                replaced[id(param)] = new
            setattr(module, name, replaced[id(param)])
        for child_name, child in list(module.named_children()):
            if isinstance(child, RotaryEmbedding):  # its cos/sin tables are computed, not loaded
                with _default_dtype(dtype), torch.device(device):
                    setattr(module, child_name, RotaryEmbedding(child.rope, config.head_dim,
                                                                config.max_position_embeddings))  # fmt: skip
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"tensors left on the meta device: {left[:3]}"


def _load_prequantized(
    config: ModelConfig,
    quantization: CheckpointQuantization,
    where: tuple[torch.dtype, torch.device],
    backend: AttentionBackend,
    tp: TensorParallel,
    files: list[Path],
) -> DecoderForCausalLM:
    dtype, device = where
    if tp.size > 1:
        raise ValueError(f"pre-quantized ({quantization.scheme}) checkpoints load with tensor_parallel_size 1 only")
    with _default_dtype(dtype), torch.device("meta"):
        model = model_class(config.architecture)(config, backend, tp)
    with _open_checkpoint(files) as (get, names, got):
        _swap_in_quantized_linears(model, quantization, (get, names), (dtype, torch.device(device)))
        _materialize(model, config, dtype, torch.device(device))
        load_weights(model, files, already_loaded=frozenset(got))
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
