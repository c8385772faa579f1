"""Per-request block tables on top of the BlockPool: prefix-cache lookup, slot allocation, freeing."""

from __future__ import annotations

from hpi_runtime.core.block_pool import BlockPool, KVBlock
from hpi_runtime.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many leading blocks are registered by hash
        self._blocks_cached_this_step: list[KVBlock] = []  # their KV is written by the step in flight
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_free_blocks_after_admission(self, request: Request, computed_blocks: list[KVBlock]) -> int:
        """Free blocks left once all of a waiting request's tokens hold blocks, its prefix hit shared; negative
        if they do not fit. Counts the whole prompt, not just the first chunk: the later chunks need it too."""
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        num_needed = -(-request.num_tokens // self.block_size) - len(computed_blocks)
        return self.pool.num_free - num_evictable_hits - num_needed

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest cached prefix of the request, in full blocks, leaving at least one token to compute.

        The last token always has to run through the model to produce the next token's logits, so the hit
        is capped at num_tokens - 1, rounded down to whole blocks.
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones; None if the pool is short.

        `computed_blocks` (the prefix hit of a request being admitted) are shared, not copied; passing
        them, even empty, counts the admission in the prefix-cache stats (only its first admission, so the
        hit rate is not inflated by recomputes). Returns the newly allocated blocks.
        """
        size = self.block_size
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
        num_tokens = request.num_computed_tokens + num_new_tokens
        if computed_blocks is not None:  # admission: share the hit, count it
            assert not blocks, "admitting a request that still holds blocks"
            num_tokens += len(computed_blocks) * size
            num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
            if -(-num_tokens // size) - len(computed_blocks) > self.pool.num_free - num_evictable_hits:
                return None
            if self.enable_caching and request.num_preemptions == 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed_blocks) * size
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
        num_needed = -(-num_tokens // size) - len(blocks)
        new_blocks = []
        if num_needed > 0:  # most decode steps need none: this path stays off the hot loop
            if num_needed > self.pool.num_free:
                return None
            new_blocks = self.pool.get_new_blocks(num_needed)
            blocks.extend(new_blocks)
        # Register newly full blocks. Done at allocation, as in vLLM: a later hit is scheduled after (or in
        # the same forward as) the step that writes this KV, and attention writes a layer's KV before
        # reading it.
        num_full = min(num_tokens // size, len(request.block_hashes))
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if self.enable_caching and num_full > num_cached:
            for i in range(num_cached, num_full):
                if self.pool.cache_block(blocks[i], request.block_hashes[i]):
                    self._blocks_cached_this_step.append(blocks[i])
            self._num_cached_blocks[request.request_id] = num_full
        return new_blocks

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(block.block_id for block in self.req_to_blocks.get(request_id, ()))

    def begin_step(self) -> None:
        """The previous step completed: the blocks it registered now hold their KV."""
        self._blocks_cached_this_step.clear()

    def uncache_step(self) -> None:
        """The step in flight failed: its newly registered blocks may hold garbage, so stop sharing them."""
        for block in self._blocks_cached_this_step:
            self.pool.uncache_block(block)
        self._blocks_cached_this_step.clear()

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are the first to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))
