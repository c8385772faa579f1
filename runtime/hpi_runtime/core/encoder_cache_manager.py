"""The encoder cache's bookkeeping (vLLM v1's EncoderCacheManager): which images' vision-encoder embeddings the
executor holds, under their content hash, within a budget of embedding rows.

The executor keeps the embeddings themselves (worker/multimodal.py); this side decides. An entry is either in
use (some unfinished request still has placeholder tokens of that image to compute) or freeable: kept, so
that the same image in a later request is not encoded again, until its room is needed, least recently
released first. Evicted hashes travel to the executor with the next step that reaches it
(`SchedulerOutput.free_encoder_hashes`).
"""

from __future__ import annotations

from collections import OrderedDict

from hpi_runtime.multimodal.inputs import MultiModalInput


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size  # embedding rows
        self.num_free = cache_size  # rows held by no entry
        self.users: dict[str, set[str]] = {}  # hash -> ids of the requests using it (every cached entry)
        self.sizes: dict[str, int] = {}
        self.freeable: OrderedDict[str, None] = OrderedDict()  # cached entries nobody uses, oldest release first
        self.num_freeable = 0  # rows of those
        self.num_queries = 0  # images a request needed embeddings of (cumulative)
        self.num_hits = 0  # of those, already cached
        self._freed: list[str] = []  # evicted, not yet sent to the executor

    @property
    def usage(self) -> float:
        """Rows held for running requests over the cache's size (freeable entries count as free, as KV blocks do)."""
        in_use = self.cache_size - self.num_free - self.num_freeable
        return in_use / self.cache_size if self.cache_size else 0.0

    def use_cached(self, request_id: str, mm: MultiModalInput) -> bool:
        """If `mm`'s embeddings are cached, take a reference for `request_id` and say so (a hit)."""
        users = self.users.get(mm.mm_hash)
        if users is None:
            return False
        if request_id not in users:
            self.num_queries += 1
            self.num_hits += 1
            if not users:
                del self.freeable[mm.mm_hash]
                self.num_freeable -= self.sizes[mm.mm_hash]
            users.add(request_id)
        return True

    def fits(self, num_rows: int) -> bool:
        """Whether `num_rows` more rows fit, evicting freeable entries if need be."""
        return num_rows <= self.num_free + self.num_freeable

    def allocate(self, request_id: str, mm: MultiModalInput) -> None:
        """Room for `mm`'s embeddings (computed this step), referenced by `request_id`; the caller checked `fits`."""
        assert mm.mm_hash not in self.users, f"image {mm.mm_hash} is cached already"
        while self.num_free < mm.length:
            evicted, _ = self.freeable.popitem(last=False)
            size = self.sizes.pop(evicted)
            del self.users[evicted]
            self.num_freeable -= size
            self.num_free += size
            self._freed.append(evicted)
        self.num_queries += 1
        self.num_free -= mm.length
        self.users[mm.mm_hash] = {request_id}
        self.sizes[mm.mm_hash] = mm.length

    def release(self, request_id: str, mm: MultiModalInput) -> None:
        """`request_id` needs `mm`'s embeddings no more (computed past its placeholders, finished, preempted)."""
        users = self.users.get(mm.mm_hash)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            self.freeable[mm.mm_hash] = None
            self.num_freeable += self.sizes[mm.mm_hash]

    def forget(self, mm_hashes) -> None:
        """Drop entries the executor may not hold (a failed step's encodings), whoever used them."""
        for mm_hash in mm_hashes:
            users = self.users.pop(mm_hash, None)
            if users is None:
                continue
            size = self.sizes.pop(mm_hash)
            if not users:
                del self.freeable[mm_hash]
                self.num_freeable -= size
            self.num_free += size
            self._freed.append(mm_hash)

    @property
    def freed(self) -> tuple[str, ...]:
        """Evicted entries the executor still holds (sent with each step until one reaches the executor)."""
        return tuple(self._freed)

    def clear_freed(self) -> None:
        self._freed.clear()
