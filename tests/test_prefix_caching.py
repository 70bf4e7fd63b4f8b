"""Prefix caching through the engine: hit sizes at block boundaries, bit-identical outputs,
isolation by cache_salt / KV dtype / weights, eviction under a tiny pool, same-call
duplicates, multi-turn chat, preemption reusing its own blocks."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.kv.manager import KVCacheManager

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BASE = list(range(500, 600))


def run(llm, prompts, params=GREEDY, **kw):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llm_factory):
    return tiny_llm_factory(num_blocks=64)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 64])
def test_repeat_hits_block_aligned_prefix_and_matches_cold(llm, n):
    llm.reset_prefix_cache()
    cold = run(llm, [BASE[:n]])[0]
    warm = run(llm, [BASE[:n]])[0]
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == (n - 1) // 16 * 16
    assert warm.token_ids == cold.token_ids


def test_cache_salt_isolates(llm):
    llm.reset_prefix_cache()
    run(llm, [BASE[:40]], cache_salt="tenant-a")
    assert run(llm, [BASE[:40]], cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert run(llm, [BASE[:40]])[0].num_cached_tokens == 0
    assert run(llm, [BASE[:40]], cache_salt="tenant-a")[0].num_cached_tokens == 32


def test_extra_keys_isolate_dtype_and_weights():
    """Two caches that differ in KV dtype or weights version never share a block."""
    class R:
        def __init__(self, rid):
            self.request_id, self.all_token_ids, self.num_computed_tokens, self.cache_salt = rid, BASE[:40], 0, None

    base = (("model", "m"), ("weights", "v1"), ("kv_dtype", "float32"))
    mgr = KVCacheManager(16, 16, True, base)
    first = R("a")
    assert mgr.allocate_slots(first, 40)
    mgr.cache_full_blocks(first, 40)
    mgr.free("a")
    for changed in [(("model", "m"), ("weights", "v2"), ("kv_dtype", "float32")),
                    (("model", "m"), ("weights", "v1"), ("kv_dtype", "float16"))]:
        mgr.extra_keys = changed
        assert mgr.get_computed_blocks(R("b")).num_tokens == 0
    mgr.extra_keys = base
    assert mgr.get_computed_blocks(R("c")).num_tokens == 32


def test_same_call_duplicates_equal_two_calls(llm):
    llm.reset_prefix_cache()
    together = run(llm, [BASE[:50], BASE[:50]])
    llm.reset_prefix_cache()
    apart = [run(llm, [BASE[:50]])[0], run(llm, [BASE[:50]])[0]]
    assert [o.token_ids for o in together] == [o.token_ids for o in apart]
    assert together[1].num_cached_tokens == 0  # not written yet when the second was admitted
    assert apart[1].num_cached_tokens == 48


def test_tiny_pool_evicts_and_hits_only_valid_blocks(tiny_llm_factory, llm):
    small = tiny_llm_factory(num_blocks=6)
    a, b = BASE[:60], list(range(700, 760))
    cold_a = run(llm, [a])[0].token_ids
    first = run(small, [a])[0]
    run(small, [b])                      # 4 blocks of b evict most of a's cached blocks
    again = run(small, [a])[0]
    assert again.token_ids == first.token_ids == cold_a
    assert again.num_cached_tokens < 48   # evicted blocks are not hits
    assert small.engine.kv_manager.pool.num_evictions > 0
    small.engine.kv_manager.check_invariants()


def test_preempted_request_reuses_its_own_blocks(tiny_llm_factory):
    small = tiny_llm_factory(num_blocks=8, max_num_batched_tokens=64)
    prompts = [list(range(100 + 100 * i, 140 + 100 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = run(small, prompts, params)
    eng = small.engine
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv_manager.prefix_hits > 0  # recompute found the victims' own published blocks
    solo = tiny_llm_factory(num_blocks=64, enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in run(solo, prompts, params)]


def test_disabled_prefix_caching_never_hits(tiny_llm_factory):
    off = tiny_llm_factory(enable_prefix_caching=False)
    run(off, [BASE[:40]])
    assert run(off, [BASE[:40]])[0].num_cached_tokens == 0
    assert off.stats().blocks_cached == 0


def test_stats_split_and_reset(llm):
    llm.reset_prefix_cache()
    run(llm, [BASE[:40]])
    s = llm.stats()
    assert (s.blocks_used, s.blocks_cached, s.blocks_free) == (0, 2, 62)
    assert s.prefix_cache_queries >= 40
    assert llm.reset_prefix_cache() == 2
    assert llm.stats().blocks_cached == 0


@pytest.mark.slow
def test_multi_turn_chat_hits_previous_turn(smollm):
    smollm.reset_prefix_cache()
    msgs = [{"role": "user", "content": "Name three primary colours, briefly."}]
    first = smollm.chat(msgs, SamplingParams(max_tokens=24, temperature=0.0))[0]
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And three secondary ones?"}]
    turn1_tokens = first.num_prompt_tokens + len(first.token_ids)
    second = smollm.chat(msgs, SamplingParams(max_tokens=8, temperature=0.0))[0]
    # turn 2's prompt starts with turn 1's prompt and answer: every full block of those hits
    # (the answer's last block may differ in the template's end-of-turn tokens)
    assert second.num_cached_tokens >= (turn1_tokens - 16) // 16 * 16 > 0
