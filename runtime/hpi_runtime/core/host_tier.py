"""The host-memory KV tier: a second block pool, in host RAM, behind the device pool.

Two uses, both decided here and carried out by the executor (`KVTransfers`, run before the step's forward):
- **Offload on eviction.** A full, hashed device block about to be evicted is copied here under the same
  chained hash. A prefix lookup that misses on device and hits here loads the block back instead of
  recomputing it (LMCache's and SGLang's hierarchical cache idea, vLLM's offloading connector).
- **Swap on preemption.** A preempted request's computed blocks are copied here and held until it resumes
  (vLLM v0's swap); full blocks already here under their hash are shared, not copied again.

Host blocks follow the device pool's rules (core/block_pool.py): ref counts, an LRU free queue, first writer
wins on a hash. Offloaded blocks are free and cached (evictable); swapped blocks are owned by the swap. Every
host block that a copy of the step in flight reads or writes holds one more reference until the next step
begins, so nothing allocated later in the same step can overwrite it before its copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpi_runtime.core.block_pool import BlockHash, BlockPool, KVBlock
from hpi_runtime.core.interface import KVTransfers


class HostKVTier:
    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self._to_host: list[tuple[int, int]] = []  # (device block id, host block id)
        self._to_device: list[tuple[int, int]] = []  # (host block id, device block id)
        self._held: list[KVBlock] = []  # host blocks a copy of the step in flight reads or writes
        self._written: list[KVBlock] = []  # host blocks registered this step: their KV lands with its copies
        self.num_blocks_to_host = 0  # cumulative copies, offloads and swaps
        self.num_blocks_to_device = 0  # cumulative loads

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Blocks owned by swapped-out requests or a copy in flight, over all blocks (cached ones count free)."""
        return self.pool.usage

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.cached_blocks)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.pool.get_cached_block(block_hash)

    def offload(self, device_block: KVBlock) -> None:
        """Copy an evicted device block here under its hash; nothing when already here or when every host
        block is owned (the KV is then lost, as without the tier)."""
        block_hash = device_block.block_hash
        assert block_hash is not None, "only hashed blocks are offloaded"
        if self.pool.get_cached_block(block_hash) is not None or self.pool.num_free == 0:
            return
        (host_block,) = self.pool.get_new_blocks(1)
        self.pool.cache_block(host_block, block_hash)
        self._copy_to_host(device_block, host_block)
        self._held.append(host_block)  # the allocation's reference, dropped when the step ends

    def swap_out(self, device_blocks: Sequence[KVBlock | None]) -> list[KVBlock | None] | None:
        """Hold host copies of `device_blocks` (a preempted request's computed blocks, in order; None for one
        outside its sliding window, kept as None): shared when a block's hash is already here, copied
        otherwise. None, and nothing changed, if they do not fit."""
        found = [
            self.pool.get_cached_block(b.block_hash) if b is not None and b.block_hash is not None else None
            for b in device_blocks
        ]
        num_new = sum(1 for block, device_block in zip(found, device_blocks, strict=True)
                      if block is None and device_block is not None)  # fmt: skip
        num_evictable_found = sum(1 for block in found if block is not None and block.ref_cnt == 0)
        if num_new > self.pool.num_free - num_evictable_found:
            return None
        self.pool.touch(block for block in found if block is not None)
        new_blocks = iter(self.pool.get_new_blocks(num_new))
        host_blocks = []
        for device_block, host_block in zip(device_blocks, found, strict=True):
            if host_block is None and device_block is not None:
                host_block = next(new_blocks)
                if device_block.block_hash is not None:
                    self.pool.cache_block(host_block, device_block.block_hash)
                self._copy_to_host(device_block, host_block)
            host_blocks.append(host_block)
        return host_blocks

    def load(self, host_block: KVBlock, device_block: KVBlock) -> None:
        """Copy a host block's KV into `device_block`; the caller holds `host_block` for this step (hold)."""
        self._to_device.append((host_block.block_id, device_block.block_id))
        self.num_blocks_to_device += 1

    def hold(self, host_blocks: Sequence[KVBlock]) -> None:
        """Keep these blocks from being reused until the step ends (they are about to be loaded)."""
        self.pool.touch(host_blocks)
        self._held.extend(host_blocks)

    def release(self, host_blocks: Sequence[KVBlock | None]) -> None:
        """Drop a swap's references: hashed blocks stay cached (free, evictable), the others are just free."""
        self.pool.free_blocks(block for block in host_blocks if block is not None)

    def take_transfers(self) -> KVTransfers:
        """This step's copies, in the order they must run; the lists start empty for the next step."""
        transfers = KVTransfers(tuple(self._to_host), tuple(self._to_device))
        self._to_host.clear()
        self._to_device.clear()
        return transfers

    def end_step(self) -> None:
        """The step in flight ran its copies: release the references that protected them."""
        self.pool.free_blocks(self._held)
        self._held.clear()
        self._written.clear()

    def uncache_step(self) -> None:
        """The step in flight failed, so its copies may not have run: forget what they were to write here."""
        for block in self._written:
            self.pool.uncache_block(block)
        self.end_step()

    def _copy_to_host(self, device_block: KVBlock, host_block: KVBlock) -> None:
        self._to_host.append((device_block.block_id, host_block.block_id))
        if host_block.block_hash is not None:
            self._written.append(host_block)
        self.num_blocks_to_host += 1
