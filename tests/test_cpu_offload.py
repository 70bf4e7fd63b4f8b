"""The CPU KV tier (issue 12, first step: ``kv_offload_memory``): blocks written through to
the tier and loaded back after the device cache evicted them give bit-identical tokens and
log-probs (batch-invariant mode) at prompt lengths around block edges; int8 pages travel
with their scales; the tier's chains stay prefix-closed under eviction; flags and stats."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schedules import OPS, assert_solo_outputs, check_with_connector, run_schedule, schedule_prompt, solo_tokens

from pagedkv import SamplingParams
from pagedkv.connectors.offload.tier_index import FreeSlots, TierIndex
from pagedkv.kv.hashing import ROOT_HASH

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
FILLERS = [list(range(3000 + 100 * i, 3000 + 100 * i + 60)) for i in range(4)]  # evict the device cache


def _prompt(n: int) -> list[int]:
    return list(range(700, 700 + n))


def _run(llm, ids):
    o = llm.generate([{"prompt_token_ids": ids}], PARAMS)[0]
    return o.token_ids, o.logprobs


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_a_prompt_reloaded_from_the_cpu_tier_gives_identical_output(tiny_llm_factory, kv_dtype):
    ref = tiny_llm_factory(num_blocks=64, batch_invariant=True, enable_prefix_caching=False, kv_cache_dtype=kv_dtype)
    llm = tiny_llm_factory(num_blocks=12, batch_invariant=True, kv_offload_memory="256KiB", kv_cache_dtype=kv_dtype)
    for n in (1, 15, 16, 17, 33, 64):
        want = _run(ref, _prompt(n))
        assert _run(llm, _prompt(n)) == want  # first time: computed, written through
        for f in FILLERS:
            _run(llm, f)
        before = llm.engine.stats().kv_offload["hit_tokens"]
        assert _run(llm, _prompt(n)) == want, n  # the device cache lost it: loaded from the tier
        hit = llm.engine.stats().kv_offload["hit_tokens"] - before
        assert hit == 16 * ((n - 1) // 16), (n, hit)
    s = llm.engine.stats().kv_offload
    assert s["blocks_loaded"] > 0 and s["blocks_saved"] > 0 and s["bytes_read"] == s["blocks_loaded"] * (
        llm.engine.parts.kv_spec.page_size_bytes)
    assert llm.engine.kv_manager.usage().used == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.lists(st.booleans(), max_size=60))
def test_free_slots_hand_out_the_order_of_a_full_stack(capacity, ops):
    """FreeSlots (a counter and the slots given back) takes slots in the order the list of every
    slot, lowest on top, took them (pop: True, give one back: False), whatever the history."""
    free, stack, taken = FreeSlots(capacity), list(range(capacity - 1, -1, -1)), []
    for take in ops:
        if take and stack:
            got = free.pop()
            assert got == stack.pop()
            taken.append(got)
        elif not take and taken:
            s = taken.pop(len(taken) // 2)
            free.append(s)
            stack.append(s)
        assert len(free) == len(stack) and sorted(free.slots()) == sorted(stack)
    if not stack:
        with pytest.raises(IndexError):
            free.pop()


def test_a_huge_tier_costs_no_memory_up_front():
    """A 1e12-slot tier (a simulated 2,000 TB disk of 2 MB pages, say) does not list its slots."""
    t = TierIndex(10**12)
    assert t.reserve(bytes(32), ROOT_HASH, (1,), step=1) == 0 and len(t._free) == 10**12 - 1


def test_tier_eviction_takes_chains_tail_first_and_lookups_stop_at_a_gap():
    t = TierIndex(3)
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    assert t.reserve(a, ROOT_HASH, (1,), step=1) is not None
    assert t.reserve(b, a, (2,), step=1) is not None
    assert t.reserve(c, b, (3,), step=1) is not None
    t.complete(1)
    assert t.reserve(d, ROOT_HASH, (4,), step=2) is not None  # full: evicts the LRU *leaf* c, not a
    assert set(t.entries) == {a, b, d} and t.num_evictions == 1
    assert t.reserve(c, bytes([9]) * 32, (3,), step=2) is None  # parent not resident: never stored
    t.complete(2)
    t.check_invariants()
    found = t.match([a, b, c], [1, 2, 3], 1, 0, 3)
    assert [e.slot for e in found] == [t.entries[a].slot, t.entries[b].slot]  # c is gone: stop there
    t.pin(found)
    assert t.reserve(c, b, (3,), step=3) is not None  # evicts d (a, b pinned; b not a leaf anyway)
    assert d not in t.entries
    t.complete(3, failed=True)  # the step that wrote c raised: c is dropped, never visible
    assert c not in t.entries
    t.unpin(found)
    t.check_invariants()


def test_lfu_keeps_the_often_hit_chain():
    t = TierIndex(2, "lfu")
    a, b, c = (bytes([i]) * 32 for i in range(3))
    t.reserve(a, ROOT_HASH, (1,), step=1)
    t.reserve(b, ROOT_HASH, (2,), step=1)
    t.complete(1)
    t.touch(a, hit=True)
    t.touch(b)  # b is the most recent, a the most hit
    t.reserve(c, ROOT_HASH, (3,), step=2)
    assert set(t.entries) == {a, c}


def test_offload_needs_prefix_caching_and_rejects_bad_values(tiny_llm_factory):
    with pytest.raises(ValueError, match="prefix caching"):
        tiny_llm_factory(kv_offload_memory="1MiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no page"):
        tiny_llm_factory(kv_offload_memory=100)
    with pytest.raises(ValueError, match="kv_offload_policy"):
        tiny_llm_factory(kv_offload_memory="1MiB", kv_offload_policy="fifo")


def test_the_flags_work_from_the_cli(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(tiny_model_dir),
                        "--num-blocks", "16", "--kv-offload-memory", "64KiB", "--kv-offload-policy", "lfu",
                        "--preemption-mode", "auto", "--max-tokens", "3", "--no-chat", "--json", "hello there"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[0])["token_ids"]) == 3
    bad = subprocess.run([sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(tiny_model_dir),
                          "--preemption-mode", "swap", "--no-chat", "hello"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "--kv-offload-memory" in bad.stderr


# ---- random schedules with a tiny device cache and a tiny tier ----------------------------
@pytest.fixture(scope="module")
def tiered(tiny_llm_factory):
    return {"tiered": tiny_llm_factory(num_blocks=6, max_model_len=64, max_num_batched_tokens=20,
                                       kv_offload_memory=8 * 8192, batch_invariant=True).engine,
            "solo": tiny_llm_factory(num_blocks=64, enable_prefix_caching=False, batch_invariant=True).engine}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_random_schedules_keep_device_and_tier_invariants(tiered, schedule):
    eng, solo = tiered["tiered"], tiered["solo"]
    assert eng.scheduler.connector.index.capacity == 8
    added, done, aborted = run_schedule(eng, schedule, check_with_connector)
    index = eng.scheduler.connector.index
    assert eng.kv_manager.pool.num_used == 0 and index.num_pinned == 0
    assert all(e.ready for e in index.entries.values())  # nothing in flight after the drain
    assert_solo_outputs(solo, added, done, aborted)


def test_concurrent_requests_on_a_tight_cache_load_shared_prefixes_from_the_tier(tiered):
    """Deterministic companion of the schedules above: fillers push a shared prefix out of
    the 6-block cache, then two requests sharing it run together and load it from the tier."""
    eng, solo = tiered["tiered"], tiered["solo"]
    before = eng.stats().kv_offload["blocks_loaded"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for kind, n in ((0, 44), (1, 48), (3, 48), (0, 46), (2, 47)):
        eng.add_request({"prompt_token_ids": schedule_prompt(kind, n)}, params, request_id=f"c{kind}-{n}")
        if kind in (1, 3):
            while eng.has_unfinished_requests():
                eng.step()
    done = {}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o.token_ids for o in eng.step() if o.finished}
        check_with_connector(eng)
    assert eng.stats().kv_offload["blocks_loaded"] > before
    for rid, (kind, n) in {"c0-46": (0, 46), "c2-47": (2, 47)}.items():
        assert done[rid] == solo_tokens(solo, schedule_prompt(kind, n), 4), rid


def test_tier_counters_reach_stats_and_prometheus(tiny_llm_factory):
    from pagedkv.server.metrics import ServerMetrics

    llm = tiny_llm_factory(num_blocks=12, kv_offload_memory=16 * 8192)
    _run(llm, _prompt(40))
    text = ServerMetrics(llm.engine.stats).render().decode()
    assert 'pagedkv_kv_offload_blocks{state="capacity",tier="cpu"} 16.0' in text
    assert 'pagedkv_kv_offload_blocks_saved_total{tier="cpu"} 2.0' in text  # 40 tokens + 4 outputs: 2 full pages
    assert "pagedkv_kv_offload_blocks" not in ServerMetrics(tiny_llm_factory().engine.stats).render().decode()


def test_copy_blocks_moves_whole_pages_byte_for_byte_and_nothing_else():
    import torch

    from pagedkv.kernels.cpu.library import load_kernel
    from pagedkv.kernels.cpu.ops import copy_pages

    load_kernel()
    torch.manual_seed(0)
    src = [torch.randn(9, 16, 2, 8), torch.randint(-127, 127, (9, 16, 2, 8), dtype=torch.int8),
           torch.randn(9, 16, 2).to(torch.bfloat16), torch.randn(9, 16, 2, 8).to(torch.float8_e4m3fn)]
    dst = [torch.zeros(5, *t.shape[1:], dtype=t.dtype) for t in src]
    before = [d.clone() for d in dst]
    sp, dp = torch.tensor([7, 0, 3]), torch.tensor([4, 1, 2])
    copy_pages(dst, dp, src, sp)
    for d, b, s in zip(dst, before, src):
        for i, j in zip(dp.tolist(), sp.tolist()):
            assert torch.equal(d[i].view(torch.uint8), s[j].view(torch.uint8))
        for i in (0, 3):  # pages not in the list are untouched
            assert torch.equal(d[i].view(torch.uint8), b[i].view(torch.uint8))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.pagedkv.copy_blocks(dst, src, torch.tensor([5]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="pages of another size"):
        torch.ops.pagedkv.copy_blocks([dst[0]], [src[2]], dp, sp)


def test_the_planner_sizes_the_tiers_as_the_engine_does(tiny_llm_factory, tiny_model_dir, tmp_path):
    from pagedkv.planner.plan import plan

    llm = tiny_llm_factory(kv_offload_memory="1MiB", kv_offload_dir=str(tmp_path), kv_offload_disk_size="5MiB")
    s = llm.engine.stats().kv_offload
    p = plan(model=str(tiny_model_dir / "config.json"), kv_cache_dtype="float32", kv_offload_memory="1MiB",
             kv_offload_disk_size="5MiB")
    assert (p.offload_cpu_blocks, p.offload_disk_blocks) == (s["capacity_blocks"], s["disk_capacity_blocks"])
    assert (p.offload_cpu_blocks, p.offload_disk_blocks) == (128, 320)
    assert p.offload_cpu_tokens == 128 * 16 and p.offload_cpu_block_load_seconds is None  # no device: sizes only
    gpu = plan(model=str(tiny_model_dir / "config.json"), gpu="h100-sxm", kv_cache_dtype="float32",
               kv_offload_memory="1MiB", kv_offload_disk_size="5MiB")
    assert gpu.offload_cpu_block_load_seconds == pytest.approx(8192 / 63.02e9)
    assert gpu.offload_disk_block_load_seconds > gpu.offload_cpu_block_load_seconds


def test_on_this_machine_the_planner_prices_a_block_at_the_page_piece_copy_rate(tiny_model_dir, monkeypatch):
    from pagedkv.planner import cpu
    from pagedkv.planner.plan import plan

    assert cpu.page_copy_bandwidth(4096, pool_bytes=8 * 2**20, copy_bytes=2**20, repeats=3) > 0
    with pytest.raises(ValueError, match="page piece"):
        cpu.page_copy_bandwidth(0)
    asked = []
    monkeypatch.setattr(cpu, "page_copy_bandwidth", lambda piece: asked.append(piece) or 1e9)
    p = plan(model=str(tiny_model_dir / "config.json"), gpu="cpu", kv_cache_dtype="float32", kv_offload_memory="1MiB")
    layers = 2  # the tiny model: a page of 8,192 B is K and V of each layer, 16 tokens x 2 heads x 16 dims x 4 B
    assert asked == [8192 // (2 * layers)]
    assert p.offload_cpu_block_load_seconds == pytest.approx(8192 / 1e9)
