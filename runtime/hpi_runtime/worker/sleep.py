"""Sleep mode for one executor's model: release the memory of its KV cache (level 1) and weights (level 2)
while keeping every tensor object, and bring the memory back on wake.

Why the same tensor objects: the runner's compiled step (compiled_model.py) and the attention layers hold
these tensors; Inductor's code (without `freeze_weights`) takes the parameters as inputs on every call and
reads their data pointers then, so tensors whose storage was shrunk to 0 bytes and grown back (at a new
address) keep the compiled step valid. Rebuilding the model instead would mean recompiling it, most of a
cold start. CUDA graphs of the decode step do bake the old addresses in: the executor drops them before
`sleep` and captures them again after `wake_up` (worker/cuda_graphs.py).

- KV cache: the storage is freed, and on wake grown back and zeroed, as at start-up (a block's unwritten
  slots are masked, but a masked NaN would still poison the weighted sum). The caller resets the prefix
  cache: every cached block's KV is gone. The host-memory KV tier is not touched.
- Weights (parameters and buffers, each storage once: tied embeddings share one): on CPU level 1 keeps them
  (they already live in host memory); on an accelerator level 1 copies them to host memory (pinned, so the
  copy back runs at full bus speed) before freeing the device's. Level 2 frees them with no copy, and wake
  re-derives them exactly as start-up did (`rebuild`: load, quantize, lay out for the CPU) into a temporary
  model and copies each storage into the original. Peak memory while waking from level 2 is therefore two
  copies of the weights, briefly.
- With Inductor freezing (`freeze_weights`), the compiled graph holds its own constant copy of the weights:
  level 2 frees only the eager copy (the answer's bytes say so), and the graph keeps working off its copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

SLEEP_LEVELS = (1, 2)


@dataclass(frozen=True)
class _Storage:
    """One storage the sleeper released: a tensor over it (its name, for weights) and its size."""

    name: str
    tensor: torch.Tensor
    num_bytes: int


def _unique_storages(named: list[tuple[str, torch.Tensor]]) -> list[_Storage]:
    seen: set[int] = set()
    unique = []
    for name, tensor in named:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        unique.append(_Storage(name, tensor, storage.nbytes()))
    return unique


def _weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _kv_caches(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    layers = model.attention_layers()
    return [(f"{i}.{kind}", getattr(attn, kind)) for i, attn in enumerate(layers) for kind in ("k_cache", "v_cache")]


def storage_bytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    """The bytes the distinct storages under these tensors hold now (0 for a released one)."""
    return sum(s.num_bytes for s in _unique_storages(tensors))


def model_storage_bytes(model: nn.Module) -> tuple[int, int]:
    """(weight bytes, KV cache bytes) the model's tensors hold now; what sleep releases, for tests and logs."""
    return storage_bytes(_weights(model)), storage_bytes(_kv_caches(model))


class ModelSleeper:
    """Releases and restores one model's memory; `level` is 0 while awake. Not thread-safe: the engine core
    (one thread) calls it between steps, when no request holds KV blocks."""

    def __init__(self, model: nn.Module, rebuild: Callable[[], nn.Module]) -> None:
        self.model = model
        self._rebuild = rebuild
        self.level = 0
        self._kv: list[_Storage] = []
        self._weights: list[_Storage] = []
        self._host_weights: list[torch.UntypedStorage] = []  # level 1 on an accelerator: each storage's bytes, on host

    def sleep(self, level: int) -> int:
        """Release what `level` releases; returns the bytes freed (on the model's device)."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level}")
        assert self.level == 0, "the engine core sleeps only an awake model"
        self._kv = _unique_storages(_kv_caches(self.model))
        freed = sum(s.num_bytes for s in self._kv)
        for s in self._kv:
            s.tensor.untyped_storage().resize_(0)
        device = next(self.model.parameters()).device
        if level == 2 or device.type != "cpu":
            self._weights = _unique_storages(_weights(self.model))
            if level == 1:
                pin = torch.cuda.is_available()
                self._host_weights = [_to_host(s.tensor, pin) for s in self._weights]
            for s in self._weights:
                s.tensor.untyped_storage().resize_(0)
            freed += sum(s.num_bytes for s in self._weights)
        self.level = level
        return freed

    def wake_up(self) -> int:
        """Restore everything `sleep` released; returns the bytes restored."""
        assert self.level != 0, "the engine core wakes only a sleeping model"
        restored = 0
        if self._weights:
            if self._host_weights:
                sources = self._host_weights
            else:
                fresh = dict(_weights(self._rebuild()))
                sources = [_checked_source(s, fresh) for s in self._weights]
            for s, source in zip(self._weights, sources, strict=True):
                storage = s.tensor.untyped_storage()
                storage.resize_(s.num_bytes)
                storage.copy_(source)
                restored += s.num_bytes
        for s in self._kv:
            s.tensor.untyped_storage().resize_(s.num_bytes)
            s.tensor.zero_()
            restored += s.num_bytes
        self._kv, self._weights, self._host_weights = [], [], []
        self.level = 0
        return restored


def _to_host(tensor: torch.Tensor, pin: bool) -> torch.UntypedStorage:
    """The whole storage under `tensor`, as bytes in host memory."""
    storage = tensor.untyped_storage()
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
    host.untyped_storage().copy_(storage)
    return host.untyped_storage()


def _checked_source(released: _Storage, fresh: dict[str, torch.Tensor]) -> torch.UntypedStorage:
    """The rebuilt model's storage for a released one; it must have the same layout, byte for byte."""
    new = fresh.get(released.name)
    old = released.tensor
    if new is None or (new.shape, new.stride(), new.dtype, new.storage_offset()) != (
        old.shape, old.stride(), old.dtype, old.storage_offset()
    ) or new.untyped_storage().nbytes() != released.num_bytes:
        raise RuntimeError(f"rebuilding the weights gave {released.name} another layout; cannot wake from level 2")
    return new.untyped_storage()
