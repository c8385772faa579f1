"""The KV block pool: ref counts, an O(1) LRU free queue and the prefix-cache hash map.

Every KV block is always in exactly one of two states: owned (ref_cnt > 0, not in the free queue) or free
(ref_cnt == 0, in the free queue). A free block may still carry a block hash: its KV stays reusable by a
later request with the same prefix until the block is popped from the head of the queue for reuse, which
evicts it from the hash map. Freed blocks join the tail, so eviction is least-recently-freed first.

The same class holds both KV tiers: the device pool and the host-memory pool (core/host_tier.py). The
device pool tells its owner about each cached block it is about to evict (`on_evict`), so that block's
KV can be copied to the host tier before the block is reused.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any

BlockHash = bytes
HashFn = Callable[[Any], BlockHash]
EvictionHook = Callable[["KVBlock"], None]  # called with a cached block just before its hash is dropped


def sha256_hash(obj: Any) -> BlockHash:
    """Default block hash: collision resistant, so one request cannot poison another's prefix cache."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def hash_block_tokens(
    hash_fn: HashFn, parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """The chained hash of one full block: it identifies the block's tokens and everything before them."""
    return hash_fn((parent_hash, tuple(token_ids), extra_keys))


class KVBlock:
    """One KV block's bookkeeping. The prev/next links belong to the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """A doubly linked list of free blocks: popleft, append and remove from the middle are all O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels, so no link is ever None inside the list
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        """Head (next to evict) to tail; O(n), for tests and debugging only."""
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Owns all KV blocks: hands them out, takes them back, and remembers cached full blocks by hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, on_evict: EvictionHook | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached ones included (they are evictable)."""
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` from the LRU head, evicting their cached content."""
        if num_blocks > self.num_free:
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {self.num_free} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if self.on_evict is not None and block.block_hash is not None:
                self.on_evict(block)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order; blocks reaching 0 join the LRU tail."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full, owned block under its chained hash; first writer wins on a duplicate."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def uncache_block(self, block: KVBlock) -> None:
        """Forget a block's hash (its KV turned out never to be written); the block itself is untouched."""
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use (as in vLLM)."""
        if self.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True
