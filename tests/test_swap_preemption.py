"""Swap preemption (issue 12, ``--preemption-mode swap|auto``): a request preempted on a tight
cache is copied to the CPU tier and back, and its greedy tokens and log-probs equal those of
a run that was never preempted (batch-invariant mode) at prompt lengths around block edges,
with fp32 and int8 pages; no room means recompute, never an abort; a swap whose step failed
is dropped; aborting a swapped request gives its slots back; ``auto`` prices both ways."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from schedules import OPS, assert_solo_outputs, check_with_connector, run_schedule

from pagedkv import SamplingParams
from pagedkv.config.engine import EngineConfig
from pagedkv.connectors.base import SwapPlan
from pagedkv.connectors.offload.tier_index import TierIndex
from pagedkv.core.preemption import PreemptionCost
from pagedkv.kv.hashing import ROOT_HASH

MAX_TOKENS = 20


def _prompts(n: int, count: int = 6) -> list[list[int]]:
    """``count`` distinct prompts, the first of ``n`` tokens, the others 5, 10, ... longer
    (so victims are preempted mid-block, not all at once on a block edge)."""
    return [list(range(500 + 97 * i, 500 + 97 * i + n + 5 * i)) for i in range(count)]


def _params():
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


def _run_all(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params())
    return [(o.token_ids, o.logprobs) for o in outs]


def _tight(n: int) -> int:
    """A pool where one request fits alone but several do not at once."""
    need = -(-(n + 15 + MAX_TOKENS) // 16)
    return need + need // 2 + 1


@pytest.mark.parametrize(("n", "kv_dtype"), [(n, "float32") for n in (1, 15, 16, 17, 33, 64)]
                         + [(17, "int8"), (64, "int8")])  # int8 pages (scales travel too): two lengths
def test_swapped_requests_give_the_tokens_of_a_run_never_preempted(tiny_llm_factory, n, kv_dtype):
    ref = tiny_llm_factory(num_blocks=64, batch_invariant=True, kv_cache_dtype=kv_dtype)
    want = [_run_all(ref, [p])[0] for p in _prompts(n)]
    llm = tiny_llm_factory(num_blocks=_tight(n), batch_invariant=True, kv_cache_dtype=kv_dtype,
                           kv_offload_memory="1MiB", preemption_mode="swap")
    assert _run_all(llm, _prompts(n)) == want
    s, by_mode = llm.engine.stats().kv_offload, llm.engine.scheduler.preemptions_by_mode
    assert by_mode["swap"] > 0 and by_mode["recompute"] == 0, by_mode
    assert s["swap_ins"] <= s["swap_outs"] == by_mode["swap"]  # a device prefix hit may cover a swap
    if n == 17:  # here (six requests) victims are preempted mid-block: their last block is copied out
        assert s["swap_blocks_out"] > 0 and s["swap_blocks_in"] > s["swap_blocks_out"] and s["swap_bytes"] > 0
    _assert_drained(llm.engine)


def _assert_drained(eng):
    c = eng.scheduler.connector
    assert eng.kv_manager.pool.num_used == 0
    assert c.index.num_held == 0 and c.index.num_pinned == 0 and not c.swap.records
    c.check_invariants()


def test_no_room_in_the_tier_means_recompute_not_an_abort(tiny_llm_factory):
    ref = tiny_llm_factory(num_blocks=64, batch_invariant=True)
    want = [_run_all(ref, [p])[0] for p in _prompts(33)]
    llm = tiny_llm_factory(num_blocks=_tight(33), batch_invariant=True, kv_offload_memory=8192,
                           preemption_mode="swap")
    assert llm.engine.scheduler.connector.index.capacity == 1
    assert _run_all(llm, _prompts(33)) == want
    s, by_mode = llm.engine.stats().kv_offload, llm.engine.scheduler.preemptions_by_mode
    assert by_mode["recompute"] > 0 and s["swap_no_room"] > 0
    _assert_drained(llm.engine)


def _preempt_one(eng, prompts):
    """Step ``eng`` until a request is swapped out; returns its id."""
    for p in prompts:
        eng.add_request({"prompt_token_ids": p}, _params())
    while not eng.scheduler.connector.swap.records:
        eng.step()
    return next(iter(eng.scheduler.connector.swap.records))


def test_aborting_a_swapped_request_gives_its_tier_slots_back(tiny_llm_factory):
    eng = tiny_llm_factory(num_blocks=_tight(17), kv_offload_memory="1MiB", preemption_mode="swap").engine
    c = eng.scheduler.connector
    rid = _preempt_one(eng, _prompts(17))
    assert c.index.num_held > 0
    eng.abort_request(rid)
    assert rid not in c.swap.records and c.index.num_held == 0
    while eng.has_unfinished_requests():
        eng.step()
    _assert_drained(eng)


def test_a_swap_whose_step_failed_is_dropped_and_the_request_recomputes(tiny_llm_factory):
    ref = tiny_llm_factory(num_blocks=64, batch_invariant=True)
    prompts = _prompts(17)
    want = {i: _run_all(ref, [p])[0][0] for i, p in enumerate(prompts)}
    eng = tiny_llm_factory(num_blocks=_tight(17), batch_invariant=True, kv_offload_memory="1MiB",
                           preemption_mode="swap").engine
    schedule, forward, failed = eng.scheduler.schedule, eng.model.forward, []

    def schedule_and_mark():
        out = schedule()
        if out.preempted_req_ids and not failed:
            failed.append(out.preempted_req_ids[0])
        return out

    def forward_once_failing(*a, **kw):
        if len(failed) == 1:
            failed.append("raised")
            raise RuntimeError("injected step failure")
        return forward(*a, **kw)
    eng.scheduler.schedule, eng.model.forward = schedule_and_mark, forward_once_failing
    ids = {eng.add_request({"prompt_token_ids": p}, _params()).request_id: i for i, p in enumerate(prompts)}
    done = {}
    while eng.has_unfinished_requests():
        try:
            done |= {o.request_id: o for o in eng.step() if o.finished}
        except RuntimeError:
            pass
    victim = failed[0]
    assert done[victim].token_ids == want[ids[victim]]  # its swap was dropped; it recomputed
    assert eng.scheduler.connector.swap.stats.dropped == 1
    _assert_drained(eng)


# ---- random schedules: swap on a tiny cache and a tiny tier --------------------------------
@pytest.fixture(scope="module")
def swapping(tiny_llm_factory):
    return {"eng": tiny_llm_factory(num_blocks=6, max_model_len=64, max_num_batched_tokens=20,
                                    kv_offload_memory=6 * 8192, preemption_mode="swap", batch_invariant=True).engine,
            "solo": tiny_llm_factory(num_blocks=64, enable_prefix_caching=False, batch_invariant=True).engine}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_random_schedules_with_swap_keep_invariants_and_outputs(swapping, schedule):
    eng, solo = swapping["eng"], swapping["solo"]
    added, done, aborted = run_schedule(eng, schedule, check_with_connector)
    _assert_drained(eng)
    assert_solo_outputs(solo, added, done, aborted)


# ---- the tier's held slots and the auto pricing ----------------------------------------------
def test_held_slots_evict_unpinned_leaves_and_count_in_the_invariant():
    t = TierIndex(3)
    a, b = bytes([1]) * 32, bytes([2]) * 32
    t.reserve(a, ROOT_HASH, (1,), step=1)
    t.reserve(b, a, (2,), step=1)
    t.complete(1)
    assert t.can_acquire(3) and not t.can_acquire(2, keep=[t.entries[b]])  # keeping b keeps a too
    slots = t.acquire(2)  # the free slot, then the leaf b
    assert len(slots) == 2 and list(t.entries) == [a] and t.num_held == 2
    t.check_invariants()
    t.pin([t.entries[a]])
    assert t.acquire(1) is None and t.num_held == 2  # a pinned entry is no victim
    t.release(slots)
    t.check_invariants()
    assert t.num_held == 0


def _plan(copy_seconds: float, reused: int = 0, kept: int = 512) -> SwapPlan:
    return SwapPlan(copy_blocks=32, copy_bytes=32 * 737280, copy_seconds=copy_seconds, kept_tokens=kept,
                    reused_tokens=reused)


def test_auto_picks_the_cheaper_way_from_measured_rates():
    cost = PreemptionCost("auto", layer_matmul_params=10**8, attn_flops_per_pair=10**4)
    assert cost.choose("r", _plan(1.0)) == "swap"  # no FLOP rate measured yet
    cost.observe([(0, 512)], seconds=1.0)
    rate = cost.flop_rate
    assert rate == pytest.approx(cost.recompute_flops(0, 512))
    assert cost.choose("r", _plan(0.5)) == "swap"      # recompute of 512 tokens: 1 s
    assert cost.choose("r", _plan(2.0)) == "recompute"
    assert cost.choose("r", _plan(0.2)) == "swap"
    assert cost.choose("r", _plan(0.2, reused=480)) == "recompute"  # the tier holds most: 32 tokens to compute
    assert cost.choose("r", None) == "recompute"
    assert [d.mode for d in cost.decisions] == ["swap", "swap", "recompute", "swap", "recompute"]
    assert PreemptionCost("swap", 10**8, 10**4).choose("r", _plan(99.0)) == "swap"
    cost.observe([(0, 4)], seconds=100.0)  # a decode-sized step measures memory, not compute: ignored
    assert cost.flop_rate == rate


def test_swap_needs_the_cpu_tier_and_a_known_mode():
    with pytest.raises(ValueError, match="--kv-offload-memory"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        EngineConfig(preemption_mode="offload", kv_offload_memory="1GiB")
    assert EngineConfig(preemption_mode="auto", kv_offload_memory="1GiB").preemption_mode == "auto"


def test_swaps_reach_stats_and_prometheus(tiny_llm_factory):
    from pagedkv.server.metrics import ServerMetrics

    llm = tiny_llm_factory(num_blocks=_tight(17), kv_offload_memory="1MiB", preemption_mode="auto")
    _run_all(llm, _prompts(17))
    st = llm.engine.stats()
    text = ServerMetrics(llm.engine.stats).render().decode()
    swaps = st.preemptions_by_mode["swap"]
    assert swaps > 0 and st.num_preemptions == swaps + st.preemptions_by_mode["recompute"]
    assert f'pagedkv_kv_offload_preemptions_total{{mode="swap"}} {float(swaps)}' in text
    assert f'pagedkv_kv_offload_swaps_total{{direction="in"}} {float(st.kv_offload["swap_ins"])}' in text
    assert st.kv_offload["copy_bytes_per_s"] > 0


def test_the_planner_weighs_a_swap_round_trip_against_a_recompute():
    from pagedkv.planner.plan import plan
    from pagedkv.planner.report import render

    big_kv = plan(model="phi-3-mini-4k", gpu="h100-sxm", seq_len=2047)  # MHA: 384 KiB of KV per token
    assert big_kv.preempt_swap_seconds == pytest.approx(2 * big_kv.host_link_seconds)
    assert big_kv.preempt_recompute_seconds == big_kv.prefill.seconds < big_kv.preempt_swap_seconds
    assert "recompute is cheaper" in render(big_kv)
    gqa = plan(model="llama-3-8b", gpu="h100-sxm", seq_len=4096)
    assert gqa.preempt_swap_seconds < gqa.preempt_recompute_seconds and "swap is cheaper" in render(gqa)
    assert plan(model="llama-3-8b").preempt_swap_seconds is None  # no device: nothing to time


def test_a_failed_swap_in_step_leaves_no_pins_once_drained(tiny_llm_factory):
    eng = tiny_llm_factory(num_blocks=5, kv_offload_memory="1MiB", preemption_mode="swap").engine
    c, forward, fired = eng.scheduler.connector, eng.model.forward, []

    def failing_swap_in(*a, **kw):
        if not fired and any(swapped for *_, swapped in c._pinned.values()):
            fired.append(1)
            raise RuntimeError("injected failure of the swap-in step")
        return forward(*a, **kw)
    eng.model.forward = failing_swap_in
    for base in (100, 300):
        eng.add_request({"prompt_token_ids": list(range(base, base + 20))}, _params())
    while eng.has_unfinished_requests():
        try:
            eng.step()
        except RuntimeError:
            pass
    assert fired and eng.scheduler.preemptions_by_mode["swap"] > 0
    _assert_drained(eng)
