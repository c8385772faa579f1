"""Adapters' host copies as the slots lay them out, kept on local disk so that reading an evicted adapter again is
one sequential read.

Host memory holds `--max-cpu-loras` adapters; one dropped from it and needed again was read from its directory
afresh: the checks, a safetensors load (fp32 as PEFT saves it) and a layout of every targeted projection part,
25-35 ms of mostly Python per rank-16 adapter of SmolLM2-135M. The prefetch thread does that beside the model's
steps, and they wait for the interpreter: with 8 adapters through 4 host copies, ~33 reads a run slowed the steps
enough to cost the served throughput 10-15% (bench/results/lora.md, run 12). Here an adapter's laid-out tensors
are written to one file of this engine's (a temporary directory, removed at shutdown) when host memory first
drops it (in the background: an engine whose adapters fit in host memory writes nothing), and a later read of the
same directory is that file read back, viewed as the same tensors: a few milliseconds, outside the interpreter.
An entry is keyed by the directory's path and its two files' sizes and modification times, so an adapter changed
on disk is read and checked afresh; a directory that fails its checks is never cached. Disk use: one host copy's
bytes per adapter evicted, at most DEFAULT_MAX_BYTES (the least recently used file removed first; the memory
--max-cpu-loras bounds is the resident copies', not these).
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from pathlib import Path

import numpy as np
import torch

from hpi_runtime.lora.peft_dir import CONFIG_FILE, WEIGHTS_FILE

logger = logging.getLogger(__name__)

# name -> the host tensors of that name (contiguous, on the CPU), as LoRAModel.read lays them out
Tensors = dict[Hashable, tuple[torch.Tensor, ...]]


ALIGNMENT = 64  # bytes: each tensor starts at a multiple (a view of another dtype needs its element size)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def directory_key(path: str) -> tuple | None:
    """What identifies an adapter directory's contents: its resolved path and its files' sizes and modification
    times (None when a file cannot be stat'ed: the full read then says what is wrong)."""
    directory = Path(path)
    try:
        stats = [(directory / name).stat() for name in (CONFIG_FILE, WEIGHTS_FILE)]
        return str(directory.resolve()), tuple((s.st_size, s.st_mtime_ns) for s in stats)
    except OSError:
        return None


DEFAULT_MAX_BYTES = 4 << 30  # files kept at most (least recently used removed first): an ephemeral-storage bound


class LayoutCache:
    """Named groups of host tensors by directory key, one file per key, at most `max_bytes` of files (the least
    recently used removed first); safe to use from several threads."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self._next = 0  # the next file's number
        self._bytes = 0  # of the files kept
        # key -> (file, its bytes, [(name, [(shape, dtype) per tensor])]), least recently used first
        self._entries: OrderedDict[tuple, tuple[Path, int, list[tuple[Hashable, list[tuple[torch.Size, torch.dtype]]]]]]
        self._entries = OrderedDict()

    def get(self, key: tuple) -> Tensors | None:
        """The tensors stored under `key`, read back from their file (new tensors), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:
            return None
        path, _, layout = entry
        try:
            flat = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        except OSError as exc:  # removed under us (by put's bound, or from outside): read the adapter afresh
            logger.info("LoRA layout cache: %s unreadable (%s); reading the adapter again", path, exc)
            with self._lock:
                if self._entries.get(key, (None,))[0] == path:
                    self._bytes -= self._entries.pop(key)[1]
            return None
        tensors: Tensors = {}
        offset = 0
        for name, shapes in layout:
            views = []
            for shape, dtype in shapes:
                offset = _aligned(offset)
                size = math.prod(shape) * dtype.itemsize
                views.append(flat[offset : offset + size].view(dtype).view(shape))
                offset += size
            tensors[name] = tuple(views)
        return tensors

    def put(self, key: tuple, tensors: Tensors) -> None:
        """Store `tensors` under `key` (a failed write only leaves them uncached; one larger than max_bytes is not
        stored)."""
        size = 0
        for group in tensors.values():
            for tensor in group:
                size = _aligned(size) + tensor.numel() * tensor.element_size()
        with self._lock:
            if key in self._entries or size > self.max_bytes:
                return
            try:
                if self._dir is None:
                    self._dir = Path(tempfile.mkdtemp(prefix="hpi-lora-layouts-"))
                    # Removed when the cache is collected or the process exits without close() (not on SIGKILL).
                    self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
            except OSError as exc:
                logger.warning("LoRA layout cache: no temporary directory (%s); evicted adapters are read from "
                               "their directories again", exc)  # fmt: skip
                return
            path = self._dir / f"{self._next}.bin"
            self._next += 1
            while self._entries and self._bytes + size > self.max_bytes:
                old_path, old_size, _ = self._entries.popitem(last=False)[1]
                old_path.unlink(missing_ok=True)
                self._bytes -= old_size
            self._bytes += size  # reserved while it is written
        try:
            with open(path, "wb") as file:
                written = 0
                for group in tensors.values():
                    for tensor in group:
                        file.write(bytes(_aligned(written) - written))
                        data = tensor.contiguous().view(torch.uint8).numpy()
                        data.tofile(file)
                        written = _aligned(written) + data.nbytes
        except OSError as exc:
            logger.warning("LoRA layout cache: cannot write %s (%s); evicted adapters are read from their "
                           "directories again", path, exc)  # fmt: skip
            path.unlink(missing_ok=True)
            with self._lock:
                self._bytes -= size
            return
        layout = [(name, [(t.shape, t.dtype) for t in group]) for name, group in tensors.items()]
        with self._lock:
            self._entries[key] = (path, size, layout)

    def close(self) -> None:
        with self._lock:
            if self._dir is not None:
                self._cleanup()
            self._dir, self._entries, self._bytes = None, OrderedDict(), 0
