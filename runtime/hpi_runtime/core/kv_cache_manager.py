"""Per-request block tables on top of the BlockPool: prefix-cache lookup, slot allocation, freeing, and the
optional host-memory tier behind the device pool (core/host_tier.py): offload on eviction, loads on a host
prefix hit, swap on preemption.

With a sliding window on every layer (`sliding_window`: a query at position p reads keys p - window + 1 .. p),
blocks wholly before the window of a request's next token are freed as it grows and their table entries
point at one shared placeholder block that no kernel reads (vLLM's sliding-window manager), so a long
request holds about window / block_size blocks, not its whole length."""

from __future__ import annotations

from dataclasses import dataclass

from hpi_runtime.core.block_pool import BlockPool, KVBlock
from hpi_runtime.core.host_tier import HostKVTier
from hpi_runtime.core.interface import NO_TRANSFERS, KVTransfers
from hpi_runtime.core.request import Request


@dataclass(frozen=True)
class ComputedKV:
    """KV a request being admitted already has, block by block from its start: a device block to share, or
    (device entry None) a host block to load into a new device block. Covers `num_tokens` tokens."""

    device_blocks: tuple[KVBlock | None, ...]
    host_blocks: tuple[KVBlock | None, ...]
    num_tokens: int

    @property
    def num_shared(self) -> int:
        return sum(1 for block in self.device_blocks if block is not None)

    @property
    def num_evictable_shared(self) -> int:
        """Shared device blocks now free (cached): sharing them takes them out of the free count."""
        return sum(1 for block in self.device_blocks if block is not None and block.ref_cnt == 0)

    @property
    def num_host_blocks(self) -> int:
        return sum(1 for block in self.host_blocks if block is not None)


NO_COMPUTED_KV = ComputedKV((), (), 0)


@dataclass(frozen=True)
class SwappedKV:
    """A preempted request's computed KV, held in the host tier until it resumes (None: a block outside the
    sliding window, which no later token reads)."""

    host_blocks: tuple[KVBlock | None, ...]
    num_tokens: int


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.host = HostKVTier(num_host_blocks) if num_host_blocks > 0 else None
        on_evict = self.host.offload if self.host is not None and enable_caching else None
        self.pool = BlockPool(num_blocks, enable_caching, on_evict)
        self.sliding_window = sliding_window
        # The placeholder behind every freed out-of-window entry: owned by the manager for good, never hashed.
        self.null_block = self.pool.get_new_blocks(1)[0] if sliding_window is not None else None
        self._num_window_freed: dict[str, int] = {}  # leading blocks already replaced by the placeholder
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many leading blocks are registered by hash
        self._blocks_cached_this_step: list[KVBlock] = []  # their KV is written by the step in flight
        self._swapped: dict[str, SwappedKV] = {}
        self._swapped_this_step: list[str] = []  # their host copies are made by the step in flight
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found, in either tier
        self.prefix_cache_host_hits = 0  # of those, tokens found only in the host tier

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def reset_prefix_cache(self) -> None:
        """Forget every device block's hash: their KV is gone (the cache was freed by sleep mode). Only when
        no request holds blocks; the host tier's blocks keep theirs (their KV is in host memory still)."""
        assert not self.req_to_blocks, "the prefix cache is reset only when no request holds blocks"
        for block in self.pool.blocks:
            self.pool.uncache_block(block)

    def num_free_blocks_after_admission(self, request: Request, computed: ComputedKV) -> int:
        """Free device blocks left once all of a waiting request's tokens hold blocks, its shared hits
        counted once; negative if they do not fit. Counts the whole prompt, not just the first chunk: the
        later chunks need it too (under a sliding window, only the window's blocks are ever held at once)."""
        num_blocks = -(-request.num_tokens // self.block_size)
        num_shared = computed.num_shared
        if self.sliding_window is not None:
            num_blocks = min(num_blocks, -(-self.sliding_window // self.block_size) + 2)
            num_shared -= sum(1 for block in computed.device_blocks if block is self.null_block)
        num_needed = num_blocks - num_shared
        return self.pool.num_free - computed.num_evictable_shared - num_needed

    def get_computed_blocks(self, request: Request, use_prefix_cache: bool = True) -> ComputedKV:
        """What a request being admitted need not compute: its swapped-out KV if it was preempted by swap,
        else the longest cached prefix over both tiers, in full blocks, leaving at least one token to compute.

        The last token always has to run through the model to produce the next token's logits, so a prefix
        hit is capped at num_tokens - 1, rounded down to whole blocks (a swap never holds the last token).
        Under a sliding window, hit blocks wholly before the window of the first token to compute come back
        as the placeholder: no query reads them, so the request does not hold (or load) them, and a hit
        longer than the pool (the window lets a request outgrow it) still admits.
        """
        swapped = self._swapped.get(request.request_id)
        if swapped is not None:
            return self._swapped_kv(request, swapped)
        if not self.enable_caching or not use_prefix_cache:
            return NO_COMPUTED_KV
        max_blocks = (request.num_tokens - 1) // self.block_size
        device_blocks, host_blocks = [], []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            host_block = self.host.lookup(block_hash) if block is None and self.host is not None else None
            if block is None and host_block is None:
                break
            device_blocks.append(block)
            host_blocks.append(host_block)
        num_tokens = len(device_blocks) * self.block_size
        if self.sliding_window is not None:  # the same one-token-early bound as _free_outside_window
            num_outside = max(0, num_tokens - self.sliding_window) // self.block_size
            device_blocks[:num_outside] = [self.null_block] * num_outside
            host_blocks[:num_outside] = [None] * num_outside
        return ComputedKV(tuple(device_blocks), tuple(host_blocks), num_tokens)

    def _swapped_kv(self, request: Request, swapped: SwappedKV) -> ComputedKV:
        # A full block still cached on device is shared rather than loaded; one the window had already
        # dropped (no host copy) comes back as the placeholder.
        device_blocks, host_blocks = [], []
        for i, host_block in enumerate(swapped.host_blocks):
            block = self.null_block if host_block is None else None
            if block is None and self.enable_caching and i < len(request.block_hashes):
                block = self.pool.get_cached_block(request.block_hashes[i])
            device_blocks.append(block)
            host_blocks.append(None if block is not None else host_block)
        return ComputedKV(tuple(device_blocks), tuple(host_blocks), swapped.num_tokens)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedKV | None = None
    ) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones; None if the pool is short.

        `computed` (what get_computed_blocks found for a request being admitted) is shared or loaded, not
        recomputed; passing it, even empty, counts the admission in the prefix-cache stats (only its first
        admission, so the hit rate is not inflated by recomputes). Returns the newly allocated blocks.
        """
        size = self.block_size
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
        elif self.sliding_window is not None:
            self._free_outside_window(request, blocks)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if computed is not None:  # admission: share or load the computed KV, count the hit
            assert not blocks, "admitting a request that still holds blocks"
            num_tokens += computed.num_tokens
            if -(-num_tokens // size) - computed.num_shared > self.pool.num_free - computed.num_evictable_shared:
                return None
            if self.enable_caching and request.num_preemptions == 0:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += computed.num_tokens
                self.prefix_cache_host_hits += computed.num_host_blocks * size
            self._admit_computed(request, computed, blocks)
        num_needed = -(-num_tokens // size) - len(blocks)
        new_blocks = []
        if num_needed > 0:  # most decode steps need none: this path stays off the hot loop
            if num_needed > self.pool.num_free:
                return None
            new_blocks = self.pool.get_new_blocks(num_needed)
            blocks.extend(new_blocks)
        # Register newly full blocks. Done at allocation, as in vLLM: a later hit is scheduled after (or in
        # the same forward as) the step that writes this KV, and attention writes a layer's KV before
        # reading it. Loaded blocks are registered here too: their copy runs before the step's forward.
        num_full = min(num_tokens // size, len(request.block_hashes))
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if self.enable_caching and num_full > num_cached:
            for i in range(num_cached, num_full):
                if blocks[i] is not self.null_block and self.pool.cache_block(blocks[i], request.block_hashes[i]):
                    self._blocks_cached_this_step.append(blocks[i])
            self._num_cached_blocks[request.request_id] = num_full
        return new_blocks

    def _admit_computed(self, request: Request, computed: ComputedKV, blocks: list[KVBlock]) -> None:
        host_blocks = [block for block in computed.host_blocks if block is not None]
        if host_blocks:  # held first: the device allocations below may offload into the host pool
            self.host.hold(host_blocks)
        null = self.null_block
        self.pool.touch(block for block in computed.device_blocks if block is not None and block is not null)
        loaded = iter(self.pool.get_new_blocks(len(host_blocks)))
        for device_block, host_block in zip(computed.device_blocks, computed.host_blocks, strict=True):
            if device_block is None:
                device_block = next(loaded)
                self.host.load(host_block, device_block)
            blocks.append(device_block)
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:  # resumed: the swap's references go; the loads hold theirs for this step
            self.host.release(swapped.host_blocks)

    def preempt(self, request: Request) -> bool:
        """Free a running request's device blocks, first copying its computed KV to the host tier when there
        is room (True: it resumes by loading it back); False: its KV is dropped and will be recomputed."""
        swapped = False
        num_blocks = -(-request.num_computed_tokens // self.block_size)
        if self.host is not None and num_blocks:
            null = self.null_block
            blocks = [None if b is null else b for b in self.req_to_blocks[request.request_id][:num_blocks]]
            host_blocks = self.host.swap_out(blocks)
            if host_blocks is not None:
                self._swapped[request.request_id] = SwappedKV(tuple(host_blocks), request.num_computed_tokens)
                self._swapped_this_step.append(request.request_id)
                swapped = True
        self._free_device_blocks(request)
        return swapped

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(block.block_id for block in self.req_to_blocks.get(request_id, ()))

    def begin_step(self) -> None:
        """The previous step completed: the blocks it registered now hold their KV, its copies have run."""
        self._blocks_cached_this_step.clear()
        self._swapped_this_step.clear()
        if self.host is not None:
            self.host.end_step()

    def take_transfers(self) -> KVTransfers:
        """The block copies this step needs before its forward (collected while scheduling)."""
        return self.host.take_transfers() if self.host is not None else NO_TRANSFERS

    def uncache_step(self) -> None:
        """The step in flight failed: its newly registered blocks may hold garbage, so stop sharing them, and
        its swaps may never have been copied, so those requests will recompute."""
        for block in self._blocks_cached_this_step:
            self.pool.uncache_block(block)
        self._blocks_cached_this_step.clear()
        for request_id in self._swapped_this_step:
            swapped = self._swapped.pop(request_id, None)
            if swapped is not None:
                self.host.release(swapped.host_blocks)
        self._swapped_this_step.clear()
        if self.host is not None:
            self.host.uncache_step()

    def free(self, request: Request) -> None:
        """Release everything the request holds in either tier (it finished or was aborted)."""
        self._free_device_blocks(request)
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None:
            self.host.release(swapped.host_blocks)

    def _free_device_blocks(self, request: Request) -> None:
        # Tail first, so the request's last blocks are the first to be evicted.
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_window_freed.pop(request.request_id, None)
        self.pool.free_blocks(block for block in reversed(blocks) if block is not self.null_block)

    def _free_outside_window(self, request: Request, blocks: list[KVBlock]) -> None:
        """Free the blocks no query from the next token on can read. The window's start is taken one token
        early, so an off-by-one between here and a kernel can only keep a block, never drop a live one."""
        num_outside = max(0, request.num_computed_tokens - self.sliding_window) // self.block_size
        start = self._num_window_freed.get(request.request_id, 0)
        if num_outside <= start:
            return
        for i in range(start, num_outside):
            if blocks[i] is not self.null_block:
                self.pool.free_blocks((blocks[i],))
                blocks[i] = self.null_block
        self._num_window_freed[request.request_id] = num_outside
