"""KVCacheManager: block tables, prefix hits, pinning, boundary arithmetic, invariants.

Requests are a tiny fake with the four fields the manager reads. The call order follows
the scheduler's contract: get_computed_blocks -> allocate_slots -> (KV written) ->
cache_full_blocks -> free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.groups import FullAttentionSpec, KVCacheGroup
from pagedkv.kv.hashing import ROOT_HASH, encode_extra_keys, hash_block, hash_blocks
from pagedkv.kv.manager import NO_HIT, ComputedBlocks, KVCacheManager


@dataclass
class FakeReq:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None


def prefill(kv: KVCacheManager, req: FakeReq) -> ComputedBlocks:
    """Admit ``req`` whole (lookup, allocate, write, publish) as the scheduler does."""
    hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(req.all_token_ids) - hit.num_tokens, hit)
    req.num_computed_tokens = len(req.all_token_ids)
    kv.cache_full_blocks(req, req.num_computed_tokens)
    return hit


def snapshot(kv: KVCacheManager) -> tuple:
    p = kv.pool
    return (list(p.ref_cnt), list(p.block_hash), list(p._free), list(p._evictable),
            dict(p._hash_to_block), p.num_evictions,
            tuple({k: list(v) for k, v in g.block_tables.items()} for g in kv.groups),
            tuple(dict(g.num_published) for g in kv.groups))


# ---- allocation --------------------------------------------------------------------------
def test_allocate_exact_ids_and_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = FakeReq("a", list(range(10))), FakeReq("b", list(range(100, 105)))
    assert kv.allocate_slots(a, 10)
    assert kv.allocate_slots(b, 5)
    assert kv.block_tables == {"a": [1, 2, 3], "b": [4, 5]}
    assert [kv.slot("a", t) for t in (0, 3, 4, 9)] == [4, 7, 8, 13]
    assert [kv.slot("b", t) for t in (0, 3, 4)] == [16, 19, 20]
    assert kv.usage() == (5, 0, 3, 8)
    kv.check_invariants()


def test_decode_grows_table_one_block_at_a_boundary():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = FakeReq("r", [1, 2, 3])
    assert kv.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    sizes = []
    for t in range(6):  # decode tokens 3..8
        r.all_token_ids.append(10 + t)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        sizes.append(len(kv.block_tables["r"]))
    assert sizes == [1, 2, 2, 2, 2, 3]  # token 4 opens block 1, token 8 opens block 2
    assert kv.block_tables["r"] == [1, 2, 3]
    kv.check_invariants()


def test_allocate_false_changes_nothing_when_pool_short():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefill(kv, FakeReq("a", list(range(8))))
    kv.free("a")  # 2 cached-evictable, 2 free
    kv.allocate_slots(FakeReq("b", [50]), 1)  # 1 in use
    before = snapshot(kv)
    big = FakeReq("c", list(range(200, 216)))
    assert kv.blocks_needed(big, 16, NO_HIT) == 4
    assert not kv.allocate_slots(big, 16)
    assert snapshot(kv) == before
    assert "c" not in kv.block_tables
    kv.check_invariants()
    assert kv.allocate_slots(FakeReq("d", list(range(300, 312))), 12)  # exactly what is left


def test_blocks_needed_at_boundaries():
    kv = KVCacheManager(num_blocks=16, block_size=16)
    fresh = FakeReq("x", [0] * 64)
    expect = {1: 1, 15: 1, 16: 1, 17: 2, 31: 2, 32: 2, 33: 3, 64: 4}
    assert {n: kv.blocks_needed(fresh, n, NO_HIT) for n in expect} == expect
    assert kv.blocks_needed(fresh, 0, NO_HIT) == 0

    hit = ComputedBlocks(([8],), 16)  # one hit block counts as held
    assert [kv.blocks_needed(fresh, n, hit) for n in (1, 16, 17)] == [1, 1, 2]

    r = FakeReq("r", [0] * 40)
    assert kv.allocate_slots(r, 15)  # one block, 15 of 16 slots
    r.num_computed_tokens = 15
    assert [kv.blocks_needed(r, n, NO_HIT) for n in (1, 2, 17, 18)] == [0, 1, 1, 2]
    assert kv.allocate_slots(r, 1)
    r.num_computed_tokens = 16
    assert [kv.blocks_needed(r, n, NO_HIT) for n in (1, 16, 17)] == [1, 1, 2]


def test_free_unknown_id_is_noop():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefill(kv, FakeReq("a", list(range(6))))
    before = snapshot(kv)
    kv.free("nobody")
    assert snapshot(kv) == before
    kv.check_invariants()


def test_free_twice_is_noop():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefill(kv, FakeReq("a", list(range(6))))
    kv.free("a")
    before = snapshot(kv)
    kv.free("a")
    assert snapshot(kv) == before
    assert kv.pool.num_available == 4


def test_free_releases_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = FakeReq("a", list(range(16)))
    prefill(kv, a)
    assert kv.block_tables["a"] == [1, 2, 3, 4]
    kv.free("a")
    assert kv.usage() == (0, 4, 0, 4)
    # a new request with a different prefix evicts a's tail first
    assert kv.allocate_slots(FakeReq("b", [99] * 4), 4)
    assert kv.block_tables["b"] == [4]
    hit = kv.get_computed_blocks(FakeReq("c", list(range(16))))
    assert hit == (([1, 2, 3],), 12)  # the head survives
    kv.check_invariants()


# ---- prefix hits -------------------------------------------------------------------------
def test_cache_full_blocks_publishes_only_full_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = FakeReq("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    kv.cache_full_blocks(a, 6)  # block 1 full, block 2 half written
    assert kv.pool.block_hash[1:4] == [kv.pool.block_hash[1], None, None]
    assert kv.pool.block_hash[1] is not None
    kv.cache_full_blocks(a, 10)
    assert kv.pool.block_hash[2] is not None and kv.pool.block_hash[3] is None
    expected = hash_blocks(a.all_token_ids, 4, encode_extra_keys(()))
    assert kv.pool.block_hash[1:3] == [(0, h) for h in expected]
    assert kv.pool.block_tokens[2] == (4, 5, 6, 7)
    kv.check_invariants()


def test_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = FakeReq("a", list(range(10)))
    prefill(kv, a)
    b = FakeReq("b", list(range(8)) + [77, 78, 79])
    hit = prefill(kv, b)
    assert hit == (([1, 2],), 8)
    assert kv.block_tables["b"] == [1, 2, 4]
    assert kv.pool.ref_cnt[:5] == [0, 2, 2, 1, 1]
    assert (kv.prefix_queries, kv.prefix_hits) == (21, 8)
    kv.check_invariants()
    kv.free("a")
    assert kv.pool.ref_cnt[:5] == [0, 1, 1, 0, 1]
    kv.free("b")
    assert kv.usage().used == 0
    kv.check_invariants()


PROMPT_LENGTHS = [1, 15, 16, 17, 31, 32, 33, 64]


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prefix_hit_leaves_at_least_one_token(length):
    kv = KVCacheManager(num_blocks=16, block_size=16)
    source = FakeReq("src", [1000 + i for i in range(80)])
    prefill(kv, source)  # 5 full blocks published
    table = list(kv.block_tables["src"])
    kv.free("src")
    req = FakeReq("q", source.all_token_ids[:length])
    hit = kv.get_computed_blocks(req)
    expect_tokens = (length - 1) // 16 * 16
    expect_blocks = table[:expect_tokens // 16]
    assert hit.num_tokens == expect_tokens
    assert hit.blocks == ((expect_blocks,) if expect_blocks else ())
    assert length - hit.num_tokens >= 1
    assert kv.allocate_slots(req, length - hit.num_tokens, hit)
    assert len(kv.block_tables["q"]) == -(-length // 16)
    assert kv.block_tables["q"][:len(expect_blocks)] == expect_blocks
    kv.check_invariants()


def test_no_hit_for_request_with_computed_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prefill(kv, FakeReq("a", list(range(12))))
    r = FakeReq("r", list(range(12)), num_computed_tokens=4)
    assert kv.get_computed_blocks(r) == NO_HIT


def test_no_hit_when_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prefill(kv, FakeReq("a", list(range(12))))
    assert all(bh is None for bh in kv.pool.block_hash)
    assert kv.get_computed_blocks(FakeReq("b", list(range(12)))) == NO_HIT
    kv.free("a")
    assert kv.usage() == (0, 0, 8, 8)


def test_hit_stops_at_first_differing_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prefill(kv, FakeReq("a", list(range(16))))
    b = FakeReq("b", [0, 1, 2, 3, 4, 5, 6, 99] + list(range(8, 16)) + [1])
    assert kv.get_computed_blocks(b) == (([1],), 4)  # blocks 2, 3 match by tokens but not by chain


@pytest.mark.parametrize("salt_a,salt_b,hits", [
    ("alice", "bob", False), ("alice", None, False), (None, "bob", False),
    ("alice", "alice", True), (None, None, True),
])
def test_cache_salt_separates_caches(salt_a, salt_b, hits):
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prefill(kv, FakeReq("a", list(range(12)), cache_salt=salt_a))
    hit = kv.get_computed_blocks(FakeReq("b", list(range(12)), cache_salt=salt_b))
    assert hit == ((([1, 2],), 8) if hits else NO_HIT)


@pytest.mark.parametrize("keys_b,hits", [
    ((("model", "m1"), ("weights", "v1")), True),
    ((("weights", "v1"), ("model", "m1")), True),  # order of the pairs does not matter
    ((("model", "m1"), ("weights", "v2")), False),
    ((("model", "m1"),), False),
    ((("model", "m1"), ("weights", "v1"), ("kv_dtype", "int8")), False),
    ((), False),
])
def test_extra_keys_are_part_of_the_cache_key(keys_b, hits):
    kv_a = KVCacheManager(num_blocks=8, block_size=4, extra_keys=(("model", "m1"), ("weights", "v1")))
    prefill(kv_a, FakeReq("a", list(range(12))))
    kv_b = KVCacheManager(num_blocks=8, block_size=4, extra_keys=keys_b)
    kv_b.pool = kv_a.pool  # same pages, other key
    for g in kv_b.groups:  # the group managers look up in the pool they were built with
        g.pool = kv_a.pool
    hit = kv_b.get_computed_blocks(FakeReq("b", list(range(12))))
    assert hit == ((([1, 2],), 8) if hits else NO_HIT)


def test_hash_fields_are_tagged():
    assert encode_extra_keys([("ab", "c")]) != encode_extra_keys([("a", "bc")])
    assert encode_extra_keys([("x", "1"), ("y", "2")]) != encode_extra_keys([("x", "1y2")])
    assert hash_block(ROOT_HASH, [1, 2], b"") != hash_block(ROOT_HASH, [1, 2], b"x")
    assert hash_block(ROOT_HASH, [1, 2], b"") != hash_block(ROOT_HASH, [2, 1], b"")
    parent2 = hash_block(ROOT_HASH, [9], b"")
    assert hash_block(ROOT_HASH, [1, 2], b"") != hash_block(parent2, [1, 2], b"")


def test_hit_blocks_are_pinned_and_never_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = FakeReq("a", list(range(12)))
    prefill(kv, a)
    kv.free("a")  # evictable LRU: 3, 2, 1; free: 4
    b = FakeReq("b", list(range(8)) + [50, 51, 52, 53, 54])  # 13 tokens, hits blocks 1, 2
    hit = kv.get_computed_blocks(b)
    assert hit == (([1, 2],), 8)
    # 2 new blocks needed; 4 are available but 2 of them are the hit itself
    assert kv.blocks_needed(b, 5, hit) == 2
    assert kv.allocate_slots(b, 5, hit)
    assert kv.block_tables["b"] == [1, 2, 4, 3]  # free 4 first, then evict 3, never 1 or 2
    assert kv.pool.num_evictions == 1
    assert kv.pool.ref_cnt == [0, 1, 1, 1, 1]
    kv.check_invariants()


def test_hit_blocks_are_pinned_before_allocation_evicts():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefill(kv, FakeReq("a", list(range(8))))
    kv.free("a")
    prefill(kv, FakeReq("b", list(range(50, 58))))
    kv.free("b")  # evictable LRU: 2, 1, 4, 3 -> the hit below is the least recently used
    c = FakeReq("c", list(range(8)) + [9])
    hit = kv.get_computed_blocks(c)
    assert hit == (([1, 2],), 8)
    assert kv.allocate_slots(c, 1, hit)
    assert kv.block_tables["c"] == [1, 2, 4]
    assert kv.get_computed_blocks(FakeReq("d", list(range(8)) + [9])) == (([1, 2],), 8)
    kv.check_invariants()


def test_allocation_refused_rather_than_evicting_the_hit():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefill(kv, FakeReq("a", list(range(12))))
    kv.free("a")
    b = FakeReq("b", list(range(8)) + list(range(50, 59)))  # 17 tokens: hit 2 + needs 3 new
    hit = kv.get_computed_blocks(b)
    assert hit == (([1, 2],), 8)
    before = snapshot(kv)
    assert not kv.allocate_slots(b, 9, hit)  # 4 available, but 2 are the hit
    assert snapshot(kv) == before
    assert kv.get_computed_blocks(FakeReq("c", list(range(12)))) == (([1, 2],), 8)
    kv.check_invariants()


def test_hit_on_in_use_blocks_does_not_count_them_as_available():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    prefill(kv, FakeReq("a", list(range(9))))  # blocks 1, 2 published and in use, 3 partial
    b = FakeReq("b", list(range(8)) + [70, 71, 72, 73, 74])  # hit 2 + needs 2
    hit = kv.get_computed_blocks(b)
    assert hit == (([1, 2],), 8)
    assert not kv.allocate_slots(b, 5, hit)  # only 0 blocks are available
    b2 = FakeReq("b2", list(range(8)) + [70])
    hit2 = kv.get_computed_blocks(b2)
    assert kv.allocate_slots(b2, 1, hit2) is False  # 1 block needed, none available
    kv.free("a")
    assert kv.allocate_slots(b2, 1, kv.get_computed_blocks(b2))
    assert kv.block_tables["b2"] == [1, 2, 3]
    kv.check_invariants()


def test_evicted_block_gives_no_stale_hit():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    prefill(kv, FakeReq("a", list(range(8))))
    kv.free("a")  # evictable: 2, 1
    other = FakeReq("o", [40, 41, 42, 43, 44, 45, 46, 47])
    assert kv.allocate_slots(other, 8)  # evicts both, before any KV is written
    assert kv.block_tables["o"] == [2, 1]
    assert not kv.pool._hash_to_block  # no entry points at the reused blocks
    kv.check_invariants()
    assert kv.get_computed_blocks(FakeReq("a2", list(range(8)) + [1])) == NO_HIT
    other.num_computed_tokens = 8
    kv.cache_full_blocks(other, 8)
    assert kv.get_computed_blocks(FakeReq("o2", other.all_token_ids + [1])) == (([2, 1],), 8)


def test_duplicate_content_stays_private():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = FakeReq("a", list(range(8))), FakeReq("b", list(range(8)))
    for r in (a, b):  # both admitted before either publishes
        assert kv.get_computed_blocks(r) == NO_HIT
        assert kv.allocate_slots(r, 8)
    for r in (a, b):
        r.num_computed_tokens = 8
        kv.cache_full_blocks(r, 8)
    assert kv.block_tables == {"a": [1, 2], "b": [3, 4]}
    assert kv.pool.block_hash[3] is None and kv.pool.block_hash[4] is None
    kv.check_invariants()
    kv.free("b")
    assert kv.usage() == (2, 0, 6, 8)  # b's copies were freed, not cached
    kv.free("a")
    assert kv.usage() == (0, 2, 6, 8)


def test_reset_prefix_cache_forgets_and_does_not_republish():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prefill(kv, FakeReq("old", list(range(8))))
    kv.free("old")  # 2 cached-evictable
    live = FakeReq("live", list(range(100, 108)))
    prefill(kv, live)  # 2 published, in use
    assert kv.reset_prefix_cache() == 4
    kv.check_invariants()
    assert kv.usage() == (2, 0, 6, 8)
    kv.cache_full_blocks(live, 8)  # blocks written before the reset stay unpublished
    assert all(bh is None for bh in kv.pool.block_hash)
    assert kv.get_computed_blocks(FakeReq("q1", list(range(8)) + [1])) == NO_HIT
    assert kv.get_computed_blocks(FakeReq("q2", list(range(100, 108)) + [1])) == NO_HIT
    kv.free("live")
    assert kv.usage() == (0, 0, 8, 8)


# Regression guard (a bug once fixed in reset_prefix_cache): see the docstring.
def test_reset_prefix_cache_treats_every_running_request_alike():
    """After a reset, KV a running request wrote before it stays unpublished (the engine's
    contract: "in-use blocks stay, unpublished"; the manager does this for ``a`` below).
    The bug: ``reset_prefix_cache`` only bumped the publish counter (now
    ``groups[g].num_published``) of requests that had published at least one block.
    ``b`` had written 3 tokens of its first block and published nothing, so after the
    reset that block, holding pre-reset KV, was published once full and served as a
    prefix hit."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = FakeReq("a", list(range(6))), FakeReq("b", list(range(50, 53)))
    for r in (a, b):
        prefill(kv, r)  # a publishes block 0; b has no full block yet
    kv.reset_prefix_cache()
    for r, more in ((a, [6, 7]), (b, [53])):  # both fill their partly written block
        r.all_token_ids += more
        assert kv.allocate_slots(r, len(more))
        r.num_computed_tokens += len(more)
        kv.cache_full_blocks(r, r.num_computed_tokens)
    assert kv.get_computed_blocks(FakeReq("qa", list(range(8)) + [0])) == NO_HIT
    assert kv.get_computed_blocks(FakeReq("qb", list(range(50, 54)) + [0])) == NO_HIT


# ---- invariants catch corruption ---------------------------------------------------------
def test_manager_invariants_catch_untracked_reference():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefill(kv, FakeReq("a", list(range(8))))
    kv.check_invariants()
    kv.block_tables["ghost"] = [1]  # a table holding a block without a reference
    with pytest.raises(AssertionError, match="ref count"):
        kv.check_invariants()


def test_manager_invariants_catch_leaked_reference():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prefill(kv, FakeReq("a", list(range(8))))
    kv.block_tables.pop("a")  # pages held, but no table: a leak
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_manager_invariants_include_pool():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.pool._evictable[1] = None
    with pytest.raises(AssertionError):
        kv.check_invariants()


# ---- the null page -----------------------------------------------------------------------
def test_null_page_is_never_allocated_nor_in_a_table():
    pool = BlockPool(3)
    assert (pool.num_pages, len(pool.ref_cnt), len(pool.block_hash), len(pool.block_tokens)) == (4, 4, 4, 4)
    assert pool.allocate(3) == [1, 2, 3]  # drained by a raw allocation: page 0 is not handed out
    with pytest.raises(RuntimeError):
        pool.allocate(1)

    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = FakeReq("a", list(range(8))), FakeReq("b", list(range(50, 58)))
    prefill(kv, a)
    prefill(kv, b)
    assert kv.block_tables == {"a": [1, 2], "b": [3, 4]}
    assert kv.usage() == (4, 0, 0, 4)
    before = snapshot(kv)
    assert not kv.allocate_slots(FakeReq("c", [7]), 1)  # drained: page 0 is no spare page
    assert snapshot(kv) == before
    assert min(kv.slot(r, 0) for r in "ab") == 4  # no slot lands in page 0
    kv.free("a")
    kv.free("b")  # evictable LRU: 2, 1, 4, 3
    d = FakeReq("d", list(range(100, 116)))
    assert kv.allocate_slots(d, 16)  # drained by eviction: page 0 is not evicted either
    assert kv.block_tables == {"d": [2, 1, 4, 3]}
    assert kv.pool.num_evictions == 4
    assert not kv.allocate_slots(FakeReq("e", [7]), 1)
    assert kv.pool.ref_cnt[0] == 0 and kv.pool.block_hash[0] is None and kv.pool.block_tokens[0] is None
    assert 0 not in kv.pool._free and 0 not in kv.pool._evictable
    assert 0 not in kv.pool._hash_to_block.values()
    kv.check_invariants()
    kv.free("d")
    assert kv.usage() == (0, 0, 4, 4)
    assert list(kv.pool._free) == [3, 4, 1, 2]  # d's table released tail first
    kv.check_invariants()
    kv.pool._free[0] = None  # queueing the null page is corruption
    with pytest.raises(AssertionError, match="null block"):
        kv.check_invariants()


# ---- several KV cache groups ---------------------------------------------------------------
def two_group_manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, kv_groups=(KVCacheGroup(FullAttentionSpec(4), (0,)),
                                                    KVCacheGroup(FullAttentionSpec(4), (1,))))


def test_two_groups_share_one_pool_all_or_nothing():
    kv = two_group_manager(8)
    a = FakeReq("a", list(range(8)))
    assert kv.blocks_needed(a, 8) == 4  # 2 pages in each group
    assert prefill(kv, a) == NO_HIT
    assert kv.get_block_ids("a") == ([1, 2], [3, 4])  # group 0 first, then group 1
    assert kv.block_tables == {"a": [1, 2]}  # group 0's tables
    assert [kv.slot("a", 5, group=g) for g in (0, 1)] == [9, 17]
    assert kv.usage() == (4, 0, 4, 8)
    h = hash_blocks(a.all_token_ids, 4, encode_extra_keys(()))
    assert kv.pool._hash_to_block == {(0, h[0]): 1, (0, h[1]): 2, (1, h[0]): 3, (1, h[1]): 4}
    assert [g.num_published for g in kv.groups] == [{"a": 2}, {"a": 2}]
    kv.check_invariants()

    b = FakeReq("b", list(range(8)) + [9])
    hit = kv.get_computed_blocks(b)
    assert hit == (([1, 2], [3, 4]), 8)  # each group hits its own pages
    assert kv.blocks_needed(b, 1, hit) == 2
    assert kv.allocate_slots(b, 1, hit)
    assert kv.get_block_ids("b") == ([1, 2, 5], [3, 4, 6])
    assert kv.pool.ref_cnt[:7] == [0, 2, 2, 2, 2, 1, 1]
    assert (kv.prefix_queries, kv.prefix_hits) == (17, 8)
    kv.check_invariants()

    # 2 pages left (7, 8): enough for group 0 alone, not for both groups
    c = FakeReq("c", list(range(100, 105)))
    assert kv.blocks_needed(c, 5) == 4
    before = snapshot(kv)
    assert not kv.allocate_slots(c, 5)
    assert snapshot(kv) == before
    assert kv.get_block_ids("c") == ([], [])
    assert kv.allocate_slots(FakeReq("c2", list(range(100, 104))), 4)  # 1 + 1: exactly what is left
    assert kv.get_block_ids("c2") == ([7], [8])
    kv.check_invariants()


def test_two_groups_hit_needs_both_and_free_is_tail_first():
    kv = two_group_manager(8)
    a = FakeReq("a", list(range(8)))
    prefill(kv, a)  # group 0 [1, 2], group 1 [3, 4], all published
    b = FakeReq("b", list(range(8)) + [9])
    prefill(kv, b)  # group 0 [1, 2, 5], group 1 [3, 4, 6]
    kv.free("b")  # 5 then 6 free (unpublished); the shared pages keep a's reference
    assert list(kv.pool._free) == [7, 8, 5, 6]
    kv.free("a")  # group 0 tail first, then group 1 tail first
    assert list(kv.pool._evictable) == [2, 1, 4, 3]
    assert kv.usage() == (0, 4, 4, 8)
    kv.check_invariants()

    d = FakeReq("d", list(range(200, 210)))  # 3 pages per group: the 4 free, then evict 2 and 1
    assert kv.allocate_slots(d, 10)
    assert kv.get_block_ids("d") == ([7, 8, 5], [6, 2, 1])
    assert kv.pool.num_evictions == 2
    e = FakeReq("e", list(range(8)) + [9])
    assert kv.groups[1].find_longest_hit(kv.block_hashes(e), e.all_token_ids, 2) == [3, 4]
    assert kv.groups[0].find_longest_hit(kv.block_hashes(e), e.all_token_ids, 2) == []
    assert kv.get_computed_blocks(e) == NO_HIT  # group 1 alone holds the prefix: no hit
    kv.check_invariants()
    kv.free("d")
    assert list(kv.pool._free) == [5, 8, 7, 1, 2, 6]  # both groups released tail first
    assert list(kv.pool._evictable) == [4, 3]
    assert kv.usage() == (0, 2, 6, 8)
    kv.check_invariants()

    # the converse: group 1 loses block 1's entry (as an eviction would), group 0 keeps it
    kv = two_group_manager(8)
    prefill(kv, FakeReq("a", list(range(8))))
    kv.pool._drop_hash(4)
    assert kv.get_computed_blocks(FakeReq("f", list(range(8)) + [9])) == (([1], [3]), 4)
    kv.check_invariants()


# ---- random operation sequences ----------------------------------------------------------
BS = 4
DOCS = [[i % 5 for i in range(13)], [(3 * i + 1) % 7 for i in range(13)]]

new_op = st.tuples(st.just("new"),
                   st.integers(0, 2),                               # doc 0, doc 1, or resubmit
                   st.integers(1, 13),                              # prefix length
                   st.lists(st.integers(0, 2), max_size=3),         # a random tail
                   st.integers(1, 6),                               # prefill chunk
                   st.sampled_from([None, None, None, "salt"]))
other_op = st.tuples(st.sampled_from(["step", "step", "free", "reset"]), st.integers(0, 99),
                     st.integers(1, 6))
ops = st.lists(st.one_of(new_op, other_op), min_size=8, max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(1, 10), prefix_caching=st.booleans())
def test_random_operations_keep_invariants(ops, num_blocks, prefix_caching):
    """Random admit / chunked prefill / decode / preempt / free / reset on a tiny pool.

    Besides the invariants, a shadow copy of the KV content checks that every prefix hit
    hands out blocks whose written KV is exactly that of the request's own prefix
    (a token's KV depends on the whole prefix before it), and that a refused allocation
    changes nothing.
    """
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    written: dict[int, dict[int, tuple[int, ...]]] = {}  # block -> offset -> prefix its KV encodes
    live: dict[str, FakeReq] = {}
    history: list[tuple[list[int], str | None]] = []

    def write(req: FakeReq, n: int) -> None:
        table = kv.block_tables[req.request_id]
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            written.setdefault(table[p // BS], {})[p % BS] = (req.cache_salt, *req.all_token_ids[:p + 1])
        req.num_computed_tokens += n
        kv.cache_full_blocks(req, req.num_computed_tokens)

    for n_op, op in enumerate(ops):
        if op[0] == "new":
            _, doc, length, tail, chunk, salt = op
            if doc == 2 and history:
                tokens, salt = list(history[-1][0]), history[-1][1]
            else:
                tokens = DOCS[doc % 2][:length] + tail
            history.append((list(tokens), salt))
            req = FakeReq(f"r{n_op}", tokens, cache_salt=salt)
            hit = kv.get_computed_blocks(req)
            assert len(hit.blocks) == (1 if hit.num_tokens else 0)  # one group, or no hit
            hit_blocks = hit.blocks[0] if hit.blocks else []
            assert hit.num_tokens < len(tokens) and len(hit_blocks) * BS == hit.num_tokens
            for i, b in enumerate(hit_blocks):
                for off in range(BS):
                    assert written[b][off] == (salt, *tokens[:i * BS + off + 1]), "hit on wrong KV"
            before = snapshot(kv)
            n = min(len(tokens) - hit.num_tokens, chunk)
            if kv.allocate_slots(req, n, hit):
                req.num_computed_tokens = hit.num_tokens
                live[req.request_id] = req
                write(req, n)
            else:
                assert snapshot(kv) == before
                kv.free(req.request_id)
        elif op[0] == "step" and live:
            _, pick, chunk = op
            req = list(live.values())[pick % len(live)]
            if req.num_computed_tokens == len(req.all_token_ids):
                req.all_token_ids.append(pick % 3)  # decode one sampled token
            n = min(len(req.all_token_ids) - req.num_computed_tokens, chunk)
            before = snapshot(kv)
            if kv.allocate_slots(req, n):
                write(req, n)
            else:
                assert snapshot(kv) == before
                kv.free(req.request_id)  # preempt
                del live[req.request_id]
        elif op[0] == "free" and live:
            rid = list(live)[op[1] % len(live)]
            kv.free(rid)
            del live[rid]
        elif op[0] == "reset":
            kv.reset_prefix_cache()
        kv.check_invariants()
        assert all(kv.pool.null_block not in t for t in kv.block_tables.values())
        usage = kv.usage()
        assert usage.used + usage.cached + usage.free == num_blocks
    for rid in list(live):
        kv.free(rid)
    kv.check_invariants()
    assert kv.pool.num_available == num_blocks
    assert kv.usage().used == 0
    assert kv.block_tables == {}
