"""KVCacheManager: prefix-cache hits share identical blocks, allocation math, tail-first freeing, stats."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from hpi_runtime.core.block_pool import sha256_hash
from hpi_runtime.core.kv_cache_manager import NO_COMPUTED_KV, KVCacheManager
from hpi_runtime.core.request import BlockHasher, Request
from hpi_runtime.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, token_ids: list[int], hasher=BlockHasher(BLOCK, sha256_hash)) -> Request:
    return Request(
        request_id,
        token_ids,
        SamplingParams(),
        max_tokens=16,
        eos_token_ids=frozenset(),
        arrival_time=0.0,
        hasher=hasher,
    )


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is not None
    request.num_computed_tokens = request.num_tokens
    return [block.block_id for block in hit.device_blocks]


def test_identical_prefix_gets_identical_blocks_and_hit_is_capped_below_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    first = make_request("a", list(range(12)))
    assert admit(kv, first) == []
    same = make_request("b", list(range(12)))  # 3 full blocks, but the last token must be computed
    assert admit(kv, same) == list(kv.block_ids("a")[:2])
    longer = make_request("c", list(range(12)) + [99, 98])
    assert admit(kv, longer) == list(kv.block_ids("a"))
    other = make_request("d", [7] + list(range(1, 12)))
    assert admit(kv, other) == []  # chained hashes: a different first block changes every later hash
    assert kv.prefix_cache_queries == 12 + 12 + 14 + 12 and kv.prefix_cache_hits == 8 + 12
    assert kv.pool.blocks[kv.block_ids("a")[0]].ref_cnt == 3


def test_root_hash_separates_caches():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    admit(kv, make_request("a", list(range(9))))
    salted = make_request("b", list(range(9)), BlockHasher(BLOCK, sha256_hash, root_hash=b"tenant-2"))
    assert admit(kv, salted) == []


def test_allocation_counts_blocks_and_refuses_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)
    request = make_request("a", list(range(5)))
    assert len(kv.allocate_slots(request, 5)) == 2
    request.num_computed_tokens = 5
    assert kv.allocate_slots(request, 3) == []  # fits in the second block's free slots
    request.num_computed_tokens = 8
    assert kv.allocate_slots(request, 5) is None  # needs 2 more, 1 free: nothing changes
    assert len(kv.block_ids("a")) == 2 and kv.pool.num_free == 1
    assert abs(kv.usage - 2 / 3) < 1e-9


def test_free_is_tail_first_so_tail_blocks_are_evicted_first():
    kv = KVCacheManager(num_blocks=7, block_size=BLOCK)
    request = make_request("a", list(range(12)))
    admit(kv, request)
    ids = kv.block_ids("a")
    kv.free(request)
    assert kv.pool.free_queue.block_ids()[-3:] == list(reversed(ids))
    # 5 blocks: the 4 never-used ones go first, then a's tail block; its prefix stays cached.
    other = make_request("z", [50] * 20)
    assert len(kv.allocate_slots(other, 20)) == 5
    assert kv.block_ids("z")[-1] == ids[2] and kv.pool.get_cached_block(request.block_hashes[2]) is None
    kv.free(other)
    assert admit(kv, make_request("b", list(range(12)))) == list(ids[:2])


def test_free_blocks_after_admission_counts_the_whole_prompt_and_evictable_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    first = make_request("a", list(range(12)))
    assert kv.num_free_blocks_after_admission(first, NO_COMPUTED_KV) == 10 - 3
    admit(kv, first)
    kv.free(first)  # its 3 blocks stay cached but free: a hit on them takes them out of the free count too
    again = make_request("b", list(range(12)) + [5] * 6)  # 18 tokens: 5 blocks, the first 3 a hit
    hit = kv.get_computed_blocks(again)
    assert hit.num_shared == 3 and kv.num_free_blocks_after_admission(again, hit) == 10 - 5
    admit(kv, again)
    assert kv.pool.num_free == 10 - 5
    shared = make_request("c", list(range(12)) + [6] * 9)  # 21 tokens: 6 blocks, 3 held by "b": 3 new
    hit = kv.get_computed_blocks(shared)
    predicted = kv.num_free_blocks_after_admission(shared, hit)
    assert predicted == 10 - 5 - 3
    # Only the first chunk is allocated here; the prediction is for the whole prompt, chunks included.
    assert kv.allocate_slots(shared, 4, hit) is not None and kv.pool.num_free == predicted + 2
    too_long = make_request("d", [9] * 40)
    assert kv.pool.num_free == 4
    assert kv.num_free_blocks_after_admission(too_long, NO_COMPUTED_KV) == 4 - 10  # does not fit


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=8))
@example(prompts=[[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]])  # the 2nd cannot hit; the 3rd hits the 1st's block
def test_equal_prefixes_always_map_to_equal_blocks(prompts):
    """With room for everything, each request hits exactly the leading full blocks some earlier request
    registered (capped below its own last token), gets the registered owner's blocks for them, and shares
    no block outside its common full-block prefix with any other request."""
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK)
    requests = [make_request(str(i), prompt) for i, prompt in enumerate(prompts)]
    registered: set = set()  # a model of the cache: the first request to compute a full block registers it
    for request in requests:
        expected_hits = 0
        while expected_hits < len(request.block_hashes) and request.block_hashes[expected_hits] in registered:
            expected_hits += 1
        expected_hits = min(expected_hits, (request.num_tokens - 1) // BLOCK)
        hit = admit(kv, request)
        assert len(hit) == expected_hits
        owners = [kv.pool.get_cached_block(h) for h in request.block_hashes[:expected_hits]]
        assert hit == [owner.block_id for owner in owners]
        registered.update(request.block_hashes)
    for a in requests:
        for b in requests:
            if a is b:
                continue
            common = 0
            while common < min(a.num_tokens, b.num_tokens) and a.token_ids[common] == b.token_ids[common]:
                common += 1
            # Blocks are shared only along the common full-block prefix, and in the same positions.
            for i, (x, y) in enumerate(zip(kv.block_ids(a.request_id), kv.block_ids(b.request_id), strict=False)):
                if x == y:
                    assert (i + 1) * BLOCK <= common
            assert len(set(kv.block_ids(a.request_id)) & set(kv.block_ids(b.request_id))) <= common // BLOCK
    for request in requests:
        kv.free(request)
    assert kv.pool.num_free == 64
