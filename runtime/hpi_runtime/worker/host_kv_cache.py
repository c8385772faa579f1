"""The host-memory KV tier's storage and the block copies a step asks for (core/host_tier.py decides them).

Per attention layer a K and a V tensor shaped like the device cache, [num_host_blocks, block_size,
num_kv_heads, head_dim], in host RAM: pinned when the device is CUDA, so copies run as DMA; on a CPU-only
run a second pool in the same memory, so the whole mechanism runs (and is tested) everywhere. A step's
`KVTransfers` run before its forward, device -> host first, then host -> device, each as one gather and
one scatter per layer. On CUDA the copies are queued on a side stream and the compute stream waits for
them, so the host is not blocked while they run.
"""

from __future__ import annotations

import torch

from hpi_runtime.core.interface import KVTransfers
from hpi_runtime.model.llama import LlamaForCausalLM


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
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        self.layers = []  # (attention layer, host k, host v)
        self.num_bytes = 0
        for attn in model.attention_layers():
            shape = (num_blocks,) + tuple(attn.k_cache.shape[1:])
            host_k = torch.zeros(shape, dtype=attn.k_cache.dtype, pin_memory=pin)
            host_v = torch.zeros(shape, dtype=attn.v_cache.dtype, pin_memory=pin)
            self.layers.append((attn, host_k, host_v))
            self.num_bytes += 2 * host_k.numel() * host_k.element_size()
        self._stream = torch.cuda.Stream(device) if pin else None

    def apply(self, transfers: KVTransfers) -> None:
        """Run a step's copies; on return the forward may read and write every block involved."""
        if not transfers:
            return
        if self._stream is None:
            self._copy(transfers)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the last step's writes are done
        with torch.cuda.stream(self._stream):
            self._copy(transfers)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _copy(self, transfers: KVTransfers) -> None:
        if transfers.to_host:
            device_ids, host_ids = _index_pair(transfers.to_host, self.device, torch.device("cpu"))
            for attn, host_k, host_v in self.layers:
                # Gathered on the device into one buffer, then one copy across (a pinned DMA on CUDA).
                host_k.index_copy_(0, host_ids, attn.k_cache.index_select(0, device_ids).to("cpu"))
                host_v.index_copy_(0, host_ids, attn.v_cache.index_select(0, device_ids).to("cpu"))
        if transfers.to_device:
            host_ids, device_ids = _index_pair(transfers.to_device, torch.device("cpu"), self.device)
            non_blocking = self._stream is not None
            for attn, host_k, host_v in self.layers:
                loaded_k = host_k.index_select(0, host_ids)
                loaded_v = host_v.index_select(0, host_ids)
                if non_blocking:
                    loaded_k, loaded_v = loaded_k.pin_memory(), loaded_v.pin_memory()
                attn.k_cache.index_copy_(0, device_ids, loaded_k.to(self.device, non_blocking=non_blocking))
                attn.v_cache.index_copy_(0, device_ids, loaded_v.to(self.device, non_blocking=non_blocking))


def _index_pair(
    pairs: tuple[tuple[int, int], ...], first_device: torch.device, second_device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = zip(*pairs, strict=True)
    return (
        torch.tensor(first, dtype=torch.long, device=first_device),
        torch.tensor(second, dtype=torch.long, device=second_device),
    )
