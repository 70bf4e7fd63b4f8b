"""BlockPool: exact block ids, free-queue order, ref counts, the hash map and its invariants.

Queue order is observed through ``allocate`` (the ids it hands out, in order), so these
tests pin the contract rather than the container: free blocks FIFO first, then
cached-evictable blocks in LRU order.
"""

from __future__ import annotations

import hashlib

import pytest

from pagedkv.kv.block_pool import BlockPool


def h(name: str) -> bytes:
    """A stand-in 32-byte block hash."""
    return hashlib.sha256(name.encode()).digest()


def drain(pool: BlockPool) -> list[int]:
    """Every available block id, in the order allocation hands them out."""
    return pool.allocate(pool.num_available)


def state(pool: BlockPool) -> tuple:
    return (list(pool.ref_cnt), list(pool.block_hash), list(pool.block_tokens), list(pool._free),
            list(pool._evictable), dict(pool._hash_to_block), pool.num_evictions)


# ---- construction and allocation ---------------------------------------------------------
def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(6)
    assert (pool.num_free, pool.num_evictable, pool.num_available, pool.num_used) == (6, 0, 6, 0)
    assert pool.allocate(3) == [1, 2, 3]  # page 0 is the null block, never handed out
    assert pool.ref_cnt == [0, 1, 1, 1, 0, 0, 0]
    assert (pool.num_free, pool.num_used) == (3, 3)
    assert pool.allocate(2) == [4, 5]
    pool.check_invariants()


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_a_block(n):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(n)


def test_allocate_zero_is_empty():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_available == 2


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    before = state(pool)
    with pytest.raises(RuntimeError, match="3 blocks, 2 available"):
        pool.allocate(3)
    assert state(pool) == before
    pool.check_invariants()


def test_released_unhashed_blocks_rejoin_free_queue_at_its_tail():
    pool = BlockPool(5)
    assert pool.allocate(3) == [1, 2, 3]
    pool.release([3, 2, 1])  # tail first
    assert pool.ref_cnt == [0] * 6
    assert drain(pool) == [4, 5, 3, 2, 1]
    pool.check_invariants()


def test_free_fifo_first_then_lru_eviction():
    pool = BlockPool(4)
    assert pool.allocate(4) == [1, 2, 3, 4]
    pool.cache_block(1, h("a"), (1,))
    pool.cache_block(2, h("b"), (2,))
    pool.release([2, 1])  # evictable LRU: 2, 1
    pool.release([4, 3])  # free FIFO: 4, 3
    assert (pool.num_free, pool.num_evictable) == (2, 2)
    pool.check_invariants()
    assert pool.allocate(1) == [4]
    assert pool.allocate(1) == [3]
    assert pool.num_evictions == 0
    assert pool.lookup(h("b"), (2,)) == 2
    assert pool.allocate(1) == [2]  # least recently released cached block goes first
    assert pool.num_evictions == 1
    assert pool.allocate(1) == [1]
    assert pool.num_evictions == 2
    pool.check_invariants()


def test_touch_refreshes_lru_position():
    pool = BlockPool(3)
    assert pool.allocate(3) == [1, 2, 3]
    for b, name in zip((1, 2, 3), "abc"):
        pool.cache_block(b, h(name), (b,))
    pool.release([1, 2, 3])  # LRU order 1, 2, 3
    pool.touch([1])  # a prefix hit on 1
    assert pool.ref_cnt[1] == 1 and pool.num_evictable == 2
    pool.check_invariants()
    pool.release([1])  # 1 becomes most recently used
    assert drain(pool) == [2, 3, 1]


def test_touch_and_release_count_references():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    pool.cache_block(b, h("x"), (7, 8))
    pool.touch([b])
    pool.touch([b])
    assert pool.ref_cnt[b] == 3
    pool.release([b])
    pool.release([b])
    assert pool.ref_cnt[b] == 1 and pool.num_evictable == 0
    pool.check_invariants()
    pool.release([b])
    assert pool.ref_cnt[b] == 0 and pool.num_evictable == 1
    pool.check_invariants()
    with pytest.raises(RuntimeError, match="released more often than held"):
        pool.release([b])


def test_release_of_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.release([1])
    pool.check_invariants()


def test_tail_first_release_evicts_request_tail_first():
    pool = BlockPool(4)
    table = pool.allocate(4)
    for i, b in enumerate(table):
        pool.cache_block(b, h(f"blk{i}"), (i,))
    pool.release(list(reversed(table)))
    assert pool.allocate(1) == [4]  # the tail goes first, the shared-prefix head survives longest
    assert pool.lookup(h("blk0"), (0,)) == 1
    assert pool.lookup(h("blk3"), (3,)) is None
    assert drain(pool) == [3, 2, 1]


# ---- prefix-cache map -------------------------------------------------------------------
def test_cache_block_and_lookup_checks_tokens():
    pool = BlockPool(3)
    [b] = pool.allocate(1)
    assert pool.lookup(h("p"), (1, 2, 3)) is None
    pool.cache_block(b, h("p"), [1, 2, 3])
    assert pool.block_tokens[b] == (1, 2, 3)
    assert pool.lookup(h("p"), (1, 2, 3)) == b
    assert pool.lookup(h("p"), (1, 2, 4)) is None  # same hash, other tokens: no hit
    assert pool.lookup(h("p"), (1, 2)) is None
    assert pool.lookup(h("q"), (1, 2, 3)) is None
    pool.check_invariants()


def test_cached_block_survives_release_until_evicted():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, h("p"), (5,))
    pool.release([b])
    assert pool.lookup(h("p"), (5,)) == b  # a ref-0 cached block is still a hit
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (1, 1, 0)


def test_block_taken_for_new_data_leaves_hash_map_at_once():
    pool = BlockPool(1)
    [b] = pool.allocate(1)
    pool.cache_block(b, h("old"), (1, 2))
    pool.release([b])
    assert pool.allocate(1) == [b]  # evicted and reused right away
    assert pool.lookup(h("old"), (1, 2)) is None
    assert h("old") not in pool._hash_to_block
    assert pool.block_hash[b] is None and pool.block_tokens[b] is None
    pool.check_invariants()
    pool.cache_block(b, h("new"), (3, 4))  # the reused block can be published again
    assert pool.lookup(h("new"), (3, 4)) == b
    pool.release([b])
    pool.check_invariants()


def test_duplicate_hash_stays_private():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, h("same"), (9,))
    pool.cache_block(b, h("same"), (9,))  # computed twice concurrently
    assert pool.block_hash[b] is None
    assert pool.lookup(h("same"), (9,)) == a
    pool.check_invariants()
    pool.release([b])  # private duplicate is freed, not cached
    assert (pool.num_free, pool.num_evictable) == (2, 0)
    pool.release([a])
    assert (pool.num_free, pool.num_evictable) == (2, 1)
    assert pool.allocate(2) == [3, b]  # free FIFO, the cached one is kept
    assert pool.lookup(h("same"), (9,)) == a
    pool.check_invariants()


def test_cache_block_twice_keeps_first_hash():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, h("first"), (1,))
    pool.cache_block(b, h("second"), (2,))
    assert pool.lookup(h("first"), (1,)) == b
    assert pool.lookup(h("second"), (2,)) is None
    pool.check_invariants()


def test_reset_prefix_cache_drops_every_hash():
    pool = BlockPool(5)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, h("a"), (1,))
    pool.cache_block(b, h("b"), (2,))
    pool.cache_block(c, h("c"), (3,))
    pool.release([b, a])  # a and b cached-evictable, c still in use
    assert pool.reset_prefix_cache() == 3
    pool.check_invariants()
    for name, tok in (("a", 1), ("b", 2), ("c", 3)):
        assert pool.lookup(h(name), (tok,)) is None
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (4, 0, 1)
    assert pool.ref_cnt[c] == 1
    pool.release([c])  # lost its hash, so it is freed, not cached
    assert (pool.num_free, pool.num_evictable) == (5, 0)
    assert drain(pool) == [4, 5, b, a, c]
    assert pool.num_evictions == 0
    assert pool.reset_prefix_cache() == 0


# ---- check_invariants catches corruption -----------------------------------------------
def _cached_pool() -> BlockPool:
    """Pool of 4: block 1 in use (hashed), block 2 cached-evictable, 3 and 4 free."""
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, h("a"), (1,))
    pool.cache_block(b, h("b"), (2,))
    pool.release([b])
    pool.check_invariants()
    return pool


def test_invariants_hold_on_a_consistent_pool():
    _cached_pool().check_invariants()


def test_invariants_catch_block_in_two_queues():
    pool = _cached_pool()
    pool._evictable[3] = None  # free block also evictable
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_invariants_catch_in_use_block_in_free_queue():
    pool = _cached_pool()
    pool.ref_cnt[3] = 1
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_invariants_catch_lost_block():
    pool = _cached_pool()
    del pool._free[4]  # in no state at all
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_invariants_catch_negative_ref_count():
    pool = _cached_pool()
    del pool._free[4]
    pool.ref_cnt[4] = -1
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_invariants_catch_free_block_with_hash():
    pool = _cached_pool()
    pool.block_hash[3] = h("ghost")
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_invariants_catch_evictable_block_without_hash():
    pool = _cached_pool()
    pool.block_hash[2] = None
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_invariants_catch_a_queued_or_held_null_block():
    for corrupt in (lambda p: p._free.update({0: None}), lambda p: p.ref_cnt.__setitem__(0, 1)):
        pool = _cached_pool()
        corrupt(pool)
        with pytest.raises(AssertionError, match="null block"):
            pool.check_invariants()


def test_null_block_is_never_handed_out():
    pool = BlockPool(3)
    assert pool.null_block == 0 and pool.num_pages == 4 and list(pool.block_ids) == [1, 2, 3]
    assert sorted(drain(pool)) == [1, 2, 3] and pool.num_available == 0


def test_invariants_catch_stale_hash_entry():
    pool = _cached_pool()
    pool._hash_to_block[h("stale")] = 3  # entry points at a block holding other data
    with pytest.raises(AssertionError):
        pool.check_invariants()
