"""Random schedules of add / abort / step on a tiny pool keep the KV invariants after every
step, end with every block free, and give each surviving request the output it gets alone.
Also: requests that can never fit are rejected at once while the others complete."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from schedules import OPS, run_schedule, solo_tokens

from pagedkv import SamplingParams


@pytest.fixture(scope="module")
def engines(tiny_llm_factory):
    # 6 blocks of 16 = 96 slots; max_model_len 64 keeps every request admissible alone.
    return {"tight": tiny_llm_factory(num_blocks=6, max_model_len=64, max_num_batched_tokens=20).engine,
            "solo": tiny_llm_factory(num_blocks=64, enable_prefix_caching=False).engine}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_random_schedules_keep_invariants(engines, schedule):
    eng, solo = engines["tight"], engines["solo"]
    added, done, aborted = run_schedule(eng, schedule, lambda e: e.kv_manager.check_invariants())
    assert eng.kv_manager.pool.num_used == 0 and not eng.kv_manager.block_tables
    for rid, (ids, n) in added.items():
        if rid not in aborted:
            assert done[rid] == solo_tokens(solo, ids, n), f"{rid} differs from its solo run"


def test_rejects_what_can_never_fit_while_others_complete(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=4)   # 4 blocks = 64 slots: max_model_len is capped at 64
    eng = llm.engine
    assert eng.max_model_len == 64
    ok = eng.add_request({"prompt_token_ids": list(range(100, 120))}, SamplingParams(max_tokens=8, temperature=0))
    with pytest.raises(ValueError,
                       match=r"= 68 exceeds max_model_len \(64, the most one request can hold in the whole KV "
                             r"cache: 4 blocks of 16 tokens\)"):
        eng.add_request({"prompt_token_ids": list(range(60))}, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match=r"prompt of 200 tokens leaves no room"):
        eng.add_request({"prompt_token_ids": list(range(200))}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"must be SamplingParams"):
        eng.add_request({"prompt_token_ids": [1]}, "greedy")
    with pytest.raises(ValueError, match="empty"):
        eng.add_request({"prompt_token_ids": []})
    with pytest.raises(ValueError, match=r"\[0, 49152\)"):
        eng.add_request({"prompt_token_ids": [5, 49152]})
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == [ok.request_id] and len(outs[0].token_ids) >= 1
    assert eng.stats().num_rejected == 5 and eng.kv_manager.pool.num_used == 0


def test_explicit_max_model_len_over_the_cache_rejects_per_request(tiny_llm_factory):
    eng = tiny_llm_factory(num_blocks=4, max_model_len=128).engine   # cache: 64 slots
    with pytest.raises(ValueError, match=r"needs 5 KV blocks of 16 tokens, but the whole cache has 4"):
        eng.add_request({"prompt_token_ids": list(range(70))}, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(128\)"):
        eng.add_request({"prompt_token_ids": list(range(60))}, SamplingParams(max_tokens=100))
    ok = eng.add_request({"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=20, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert len(ok.output_token_ids) == 20 and eng.kv_manager.pool.num_used == 0


def test_generate_rejects_bad_prompt_before_running_any(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=4)
    with pytest.raises(ValueError, match="prompt 1:"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": list(range(300))}])
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_manager.pool.num_used == 0


def test_abort_frees_blocks_and_reports_abort(tiny_llm_factory):
    eng = tiny_llm_factory(num_blocks=8).engine
    r = eng.add_request({"prompt_token_ids": list(range(100, 140))}, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.kv_manager.pool.num_used == 3
    out = eng.abort_request(r.request_id)
    assert out.finish_reason == "abort" and out.finished
    assert eng.kv_manager.pool.num_used == 0 and not eng.has_unfinished_requests()


def test_contiguous_allocator_reserves_prompt_plus_max_tokens(tiny_llm_factory):
    eng = tiny_llm_factory(num_blocks=16, kv_allocator="contiguous").engine
    eng.add_request({"prompt_token_ids": list(range(100, 120))}, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert len(eng.kv_manager.block_tables["req-0"]) == 5  # ceil((20 + 50) / 16) at admission
    alloc, filled = eng.kv_manager.slot_usage({"req-0": eng.requests["req-0"].num_computed_tokens})
    assert (alloc, filled) == (80, 20)
    paged = tiny_llm_factory(num_blocks=16).engine
    paged.add_request({"prompt_token_ids": list(range(100, 120))}, SamplingParams(max_tokens=50, ignore_eos=True))
    paged.step()
    assert len(paged.kv_manager.block_tables["req-0"]) == 2
    assert paged.kv_manager.slot_usage({"req-0": 20}) == (32, 20)


def test_a_streaming_request_too_big_for_the_step_budget_is_told_so(tiny_llm_factory):
    """A long prompt under streaming eviction holds its window plus one step's tokens; with
    the default 2,048-token step it cannot fit a small cache, and the error says which flag
    makes it fit (a new user could not tell); with a smaller step it runs, within the cache."""
    from pagedkv import SamplingParams

    kw = dict(kv_eviction="streaming", kv_window_tokens=32, num_sink_tokens=4, num_blocks=8, max_model_len=1024)
    prompt = [{"prompt_token_ids": list(range(200, 500))}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"lower --max-num-batched-tokens, now \d+, needs fewer"):
        tiny_llm_factory(**kw).generate(prompt, params)
    llm = tiny_llm_factory(**kw, max_num_batched_tokens=32)
    assert len(llm.generate(prompt, params)[0].token_ids) == 8
    assert llm.stats().peak_blocks_used <= 8
