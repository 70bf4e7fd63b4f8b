"""LLM.run owns its requests: an exception leaves none of them running, callbacks see only
the call's own requests, and its results survive any number of other endings."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams

SHORT = SamplingParams(max_tokens=1, temperature=0.0)
LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def test_an_exception_in_on_output_aborts_the_calls_other_requests(tiny_llm_factory):
    llm = tiny_llm_factory()

    def boom(out):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        llm.generate(["short", "a much longer prompt here"], [SHORT, LONG], on_output=boom)
    assert not llm.engine.requests and llm.engine.kv_manager.usage().used == 0
    seen, steps = [], llm.engine.core.num_steps
    outs = llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                        on_output=seen.append)
    assert [o.request_id for o in seen] == [outs[0].request_id]
    assert llm.engine.core.num_steps - steps <= 3  # the aborted 30-token request was not run on


def test_a_run_neither_finishes_nor_reports_other_callers_requests(tiny_llm_factory):
    llm = tiny_llm_factory()
    other = llm.add_requests(["left waiting"], LONG)
    seen = []
    mine = llm.generate(["mine"], SHORT, on_output=seen.append)
    assert [o.request_id for o in seen] == [mine[0].request_id] and other[0] in llm.engine.requests
    assert llm.run(other)[0].finish_reason == "length"


def test_own_results_survive_more_than_a_thousand_other_endings(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=256, max_num_seqs=8)
    prompts = [{"prompt_token_ids": [100 + i % 50, 7]} for i in range(1100)]
    ids = llm.add_requests(prompts, SHORT)

    def abort_the_rest(out):
        for rid in ids:
            llm.engine.abort_request(rid)

    outs = llm.run(ids, on_output=abort_the_rest)
    assert all(o is not None for o in outs) and len(outs) == 1100
    assert sum(o.finish_reason == "abort" for o in outs) >= 1090
    assert llm.engine.kv_manager.usage().used == 0


def test_priority_policy_orders_admission(tiny_llm_factory):
    llm = tiny_llm_factory(scheduling_policy="priority", max_num_seqs=1)
    order = []
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2, temperature=0.0), priority=[2, 0, 1],
                        on_output=lambda o: order.append(o.request_id))
    ids = [o.request_id for o in outs]
    assert order == [ids[1], ids[2], ids[0]]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(["a", "b"], priority=[1])


def test_on_output_sees_requests_that_end_outside_the_calls_steps(tiny_llm_factory):
    """Second break-it pass: requests aborted from ``on_output``, or finished inside a
    nested ``generate`` started from it, were returned but never shown to ``on_output``."""
    llm = tiny_llm_factory(num_blocks=64)
    short, long_ = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True)
    seen = []

    def nested(out):
        seen.append(out.request_id)
        if len(seen) == 1:
            llm.generate(["inner"], SamplingParams(max_tokens=20, ignore_eos=True))
    outs = llm.generate(["p1", "p2", "p3"], [short, long_, long_], on_output=nested)
    assert sorted(seen) == sorted(o.request_id for o in outs)

    seen.clear()
    ids = llm.add_requests(["a", "b", "c"], [short, long_, long_])

    def abort_siblings(out):
        seen.append(out.request_id)
        for rid in ids:
            llm.engine.abort_request(rid)
    outs = llm.run(ids, on_output=abort_siblings)
    assert sorted(seen) == sorted(ids) and [o.finish_reason for o in outs][1:] == ["abort", "abort"]


@pytest.mark.parametrize("bad", ["req-1", ["no-such-request"], 5])
def test_run_refuses_what_is_not_a_list_of_known_ids(tiny_llm_factory, bad):
    with pytest.raises(ValueError):
        tiny_llm_factory(num_blocks=16).run(bad)


def test_n_samples_per_prompt_are_n_seeded_requests_in_outputs(tiny_llm_factory):
    """SamplingParams(n=k), vLLM's name: k requests a prompt, choice j seeded seed + j, all
    in the first output's .outputs (each with its index); n = 1 keeps .outputs == [itself]."""
    llm = tiny_llm_factory()
    seeded = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7)
    outs = llm.generate(["hello there", "abc"], [seeded, SamplingParams(max_tokens=4, temperature=0.0)])
    assert len(outs) == 2 and [c.index for c in outs[0].outputs] == [0, 1, 2] and outs[1].outputs == [outs[1]]
    alone = [llm.generate(["hello there"], SamplingParams(max_tokens=5, temperature=1.0, seed=7 + j))[0]
             for j in range(3)]
    assert [c.token_ids for c in outs[0].outputs] == [a.token_ids for a in alone]
    assert outs[0].token_ids == outs[0].outputs[0].token_ids and llm.engine.kv_manager.usage().used == 0
    chats = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(n=2, max_tokens=3, temperature=0.0))
    assert len(chats) == 1 and [c.token_ids for c in chats[0].outputs][0] == chats[0].outputs[1].token_ids
    with pytest.raises(ValueError, match="n=2: LLMEngine.add_request runs one sample"):
        llm.engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(n=2))
    for bad in ({"n": 0}, {"n": 129}, {"n": 1.5}, {"n": 2, "seed": 2**63 - 1}):
        with pytest.raises(ValueError, match="n must be|seed must be"):
            SamplingParams(**bad)


def test_none_params_in_a_list_are_defaults_and_on_output_sees_each_choice_index(tiny_llm_factory):
    llm = tiny_llm_factory()
    outs = llm.generate(["hi", "abc"], [None, SamplingParams(n=2, max_tokens=2, temperature=0.0)])
    assert len(outs) == 2 and len(outs[1].outputs) == 2 and not llm.engine.has_unfinished_requests()
    seen = []
    llm.generate(["hello"], SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=3),
                 on_output=lambda o: seen.append(o.index))
    assert sorted(seen) == [0, 1, 2] and llm.engine.kv_manager.usage().used == 0
