"""The encoder cache's bookkeeping alone: references, least-recently-released eviction, hits, forgetting."""

from __future__ import annotations

import numpy as np

from hpi_runtime.core.encoder_cache_manager import EncoderCacheManager
from hpi_runtime.multimodal.inputs import MultiModalInput


def _image(name: str, length: int) -> MultiModalInput:
    return MultiModalInput(name, offset=0, length=length, pixel_values=np.zeros((1, 1), np.float32), grid_thw=(1, 1, 1))


def test_unused_entries_are_evicted_least_recently_released_first() -> None:
    cache = EncoderCacheManager(cache_size=10)
    a, b, c = _image("a", 4), _image("b", 4), _image("c", 4)
    cache.allocate("r1", a)
    cache.allocate("r2", b)
    assert not cache.fits(4)  # both in use: 2 rows free
    cache.release("r2", b)
    cache.release("r1", a)  # b was released first
    assert cache.fits(4) and cache.usage == 0.0
    cache.allocate("r3", c)
    assert cache.freed == ("b",) and set(cache.users) == {"a", "c"}
    assert cache.use_cached("r4", a)  # a hit pins it again
    assert (cache.num_queries, cache.num_hits) == (4, 1)
    assert not cache.fits(4)  # a and c in use now
    cache.clear_freed()
    cache.forget({"c"})
    assert cache.freed == ("c",) and cache.num_free == 6 and not cache.use_cached("r5", c)
