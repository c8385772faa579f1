"""BlockPool: O(1) LRU free queue, ref counts, prefix-cache registration and exact eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpi_runtime.core.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens, sha256_hash


def test_free_queue_popleft_append_remove_in_o1_order():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 4, 0]
    assert queue.num_free == 4
    for expected in (1, 3, 4, 0):
        assert queue.popleft().block_id == expected
    with pytest.raises(ValueError):
        queue.popleft()


def test_chained_hash_depends_on_parent_and_extra_keys():
    a = hash_block_tokens(sha256_hash, b"", [1, 2, 3])
    assert a == hash_block_tokens(sha256_hash, b"", (1, 2, 3))
    assert a != hash_block_tokens(sha256_hash, b"seed", [1, 2, 3])
    assert a != hash_block_tokens(sha256_hash, b"", [1, 2, 3], ("lora-1",))
    assert hash_block_tokens(sha256_hash, a, [4]) != hash_block_tokens(sha256_hash, b"", [4])


def test_cached_block_with_zero_refs_is_reused_until_evicted_in_lru_order():
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    for block, name in zip((a, b, c, d), (b"a", b"b", b"c", b"d"), strict=True):
        pool.cache_block(block, name)
    pool.free_blocks([c, a])  # c freed first: least recently freed, evicted first
    assert pool.num_free == 2 and pool.usage == 0.5
    assert pool.get_cached_block(b"a") is a  # still reusable
    pool.touch([a])  # a prefix hit revives it out of the free queue
    assert a.ref_cnt == 1 and pool.num_free == 1
    (reused,) = pool.get_new_blocks(1)
    assert reused is c and pool.get_cached_block(b"c") is None and c.block_hash is None
    pool.free_blocks([a, b, c, d])
    assert pool.free_queue.block_ids() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


def test_uncache_forgets_a_hash_and_duplicate_hash_keeps_first():
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    assert pool.cache_block(a, b"x")
    assert not pool.cache_block(b, b"x")  # same content computed twice: the first block stays cached
    assert pool.get_cached_block(b"x") is a and b.block_hash is None
    pool.uncache_block(a)
    assert pool.get_cached_block(b"x") is None and a.block_hash is None and a.ref_cnt == 1


def test_caching_disabled_registers_nothing_and_reset_needs_idle_pool():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"x")
    assert pool.get_cached_block(b"x") is None
    cached = BlockPool(2)
    (b,) = cached.get_new_blocks(1)
    cached.cache_block(b, b"y")
    assert not cached.reset_prefix_cache()
    cached.free_blocks([b])
    assert cached.reset_prefix_cache() and cached.get_cached_block(b"y") is None


def test_double_free_is_an_internal_error():
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(AssertionError):
        pool.free_blocks([a])


# One pool operation: allocate n, free one owner's blocks, cache an owned block, or touch a cached hash.
_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]), st.integers(0, 7), st.integers(0, 5)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 8), ops=_ops)
def test_pool_matches_a_reference_lru_model(num_blocks, ops):
    """Against a plain-list model: ref counts, the free queue's exact order, hits and evictions."""
    pool = BlockPool(num_blocks)
    owners: list[list] = []  # each owner holds a list of blocks (one reference each)
    model_free = list(range(num_blocks))  # LRU order, head first
    model_ref = [0] * num_blocks
    model_hash: dict[int, bytes] = {}  # block id -> hash
    for op, x, y in ops:
        if op == "alloc" and 0 < x <= len(model_free):
            blocks = pool.get_new_blocks(x)
            expected = model_free[:x]
            del model_free[:x]
            assert [block.block_id for block in blocks] == expected
            for block_id in expected:
                model_hash.pop(block_id, None)
                model_ref[block_id] = 1
            owners.append(blocks)
        elif op == "free" and owners:
            blocks = owners.pop(x % len(owners))
            pool.free_blocks(reversed(blocks))
            for block in reversed(blocks):
                model_ref[block.block_id] -= 1
                if model_ref[block.block_id] == 0:
                    model_free.append(block.block_id)
        elif op == "cache" and owners:
            blocks = owners[x % len(owners)]
            block = blocks[y % len(blocks)]
            block_hash = bytes([y])
            pool.cache_block(block, block_hash)
            if block.block_id not in model_hash and block_hash not in model_hash.values():
                model_hash[block.block_id] = block_hash
        elif op == "touch":
            block_hash = bytes([y])
            hit = pool.get_cached_block(block_hash)
            owner_ids = [bid for bid, h in model_hash.items() if h == block_hash]
            assert ([hit.block_id] if hit else []) == owner_ids
            if hit is not None:
                pool.touch([hit])
                if model_ref[hit.block_id] == 0:
                    model_free.remove(hit.block_id)
                model_ref[hit.block_id] += 1
                owners.append([hit])
        assert pool.free_queue.block_ids() == model_free
        assert [block.ref_cnt for block in pool.blocks] == model_ref
        assert {block.block_id: block.block_hash for block in pool.blocks if block.block_hash} == model_hash
        assert all(ref >= 0 for ref in model_ref)
    for blocks in owners:
        pool.free_blocks(blocks)
    assert pool.num_free == num_blocks
