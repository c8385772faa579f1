"""The host-memory KV tier's storage and the block copies a step asks for (core/host_tier.py decides them).

Per attention layer a K and a V tensor shaped like the device cache, [num_host_blocks, block_size,
num_kv_heads, head_dim], in host RAM: pinned when the device is CUDA, so copies run as DMA; on a CPU-only
run a second pool in the same memory, so the whole mechanism runs (and is tested) everywhere.

A step's `KVTransfers` run before its forward, device -> host first, then host -> device:
- **Offloads overlap the forward.** The evicted blocks are gathered on the compute stream (so they are read
  before the forward reuses them), then copied to pinned staging memory on a side stream while the forward
  runs; the scatter into the host pool lands at the start of the next step's copies. On CPU the gather is
  the copy and the scatter is deferred the same way, so one code path is tested everywhere.
- **Loads finish first.** Loads land every pending offload (a load may read a block offloaded in the same
  step), then copy host -> device on the compute stream, ahead of the forward that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpi_kernels.reference import byte_view
from hpi_runtime.core.interface import KVTransfers
from hpi_runtime.models.decoder import DecoderForCausalLM


def num_host_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Host blocks `--kv-offload-bytes` buys: 0 turns the tier off; a budget under one block is an error."""
    if budget_bytes < 0:
        raise ValueError(f"kv_offload_bytes must not be negative, got {budget_bytes}")
    if budget_bytes == 0:
        return 0
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_offload_bytes={budget_bytes} holds no KV block ({bytes_per_block} bytes each); "
            "raise it or set 0 to turn the host tier off"
        )
    return int(num_blocks)


class HostKVCache:
    def __init__(self, model: DecoderForCausalLM, num_blocks: int, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self.layers = []  # (attention layer, host k, host v)
        self.num_bytes = 0
        for attn in model.attention_layers():
            shape = (num_blocks,) + tuple(attn.k_cache.shape[1:])
            host_k = torch.zeros(shape, dtype=byte_view(attn.k_cache).dtype, pin_memory=self._pinned)
            host_v = torch.zeros(shape, dtype=byte_view(attn.v_cache).dtype, pin_memory=self._pinned)
            self.layers.append((attn, host_k, host_v))
            self.num_bytes += 2 * host_k.numel() * host_k.element_size()
        self._stream = torch.cuda.Stream(device) if self._pinned else None
        self._pending: _PendingOffload | None = None

    def apply(self, transfers: KVTransfers) -> None:
        """Run a step's copies; on return the forward may read and write every device block involved."""
        if not transfers:
            return
        self.finish_offloads()  # the last step's, before any host block they write is reused
        if transfers.to_host:
            self._start_offloads(transfers.to_host)
        if transfers.to_device:
            self.finish_offloads()  # a load may read a block offloaded just now
            self._load(transfers.to_device)

    def finish_offloads(self) -> None:
        """Land pending offloads in the host pool (waiting for their copies on CUDA)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.event is not None:
            pending.event.synchronize()
        for (_, host_k, host_v), (k, v) in zip(self.layers, pending.staged, strict=True):
            host_k.index_copy_(0, pending.host_ids, k)
            host_v.index_copy_(0, pending.host_ids, v)

    def _start_offloads(self, pairs: tuple[tuple[int, int], ...]) -> None:
        device_ids, host_ids = _index_pair(pairs, self.device, torch.device("cpu"))
        # On the compute stream: ordered before the forward that may overwrite these blocks.
        gathered = [(byte_view(attn.k_cache).index_select(0, device_ids),
                     byte_view(attn.v_cache).index_select(0, device_ids))
                    for attn, _, _ in self.layers]  # fmt: skip
        if self._stream is None:
            self._pending = _PendingOffload(host_ids, gathered, None, ())
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            staged = []
            for k, v in gathered:
                k_host = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
                v_host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                k_host.copy_(k, non_blocking=True)
                v_host.copy_(v, non_blocking=True)
                staged.append((k_host, v_host))
            event = torch.cuda.Event()
            event.record(self._stream)
        # `gathered` stays referenced until the event has passed: its memory must outlive the copies.
        self._pending = _PendingOffload(host_ids, staged, event, gathered)

    def _load(self, pairs: tuple[tuple[int, int], ...]) -> None:
        host_ids, device_ids = _index_pair(pairs, torch.device("cpu"), self.device)
        for attn, host_k, host_v in self.layers:
            for cache, host in ((attn.k_cache, host_k), (attn.v_cache, host_v)):
                loaded = host.index_select(0, host_ids)
                if self._pinned:  # a DMA from pinned memory; the allocator keeps it until the copy ran
                    loaded = loaded.pin_memory().to(self.device, non_blocking=True)
                byte_view(cache).index_copy_(0, device_ids, loaded)


@dataclass(frozen=True)
class _PendingOffload:
    host_ids: torch.Tensor  # [num_blocks] int64, on the host
    staged: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [num_blocks, block_size, heads, dim]
    event: object  # torch.cuda.Event recorded after the copies, or None on CPU
    keep_alive: object  # device tensors the copies read, held until they ran


def _index_pair(
    pairs: tuple[tuple[int, int], ...], first_device: torch.device, second_device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = zip(*pairs, strict=True)
    return (
        torch.tensor(first, dtype=torch.long, device=first_device),
        torch.tensor(second, dtype=torch.long, device=second_device),
    )
