"""Scheduler over a tiny KVCacheManager and a fake runner: exact SchedulerOutputs (chunk
sizes, block ids per group, deltas, preemption order) and what ``update`` applies.

The fake runner keeps its own copy of each request from the plain data alone, as a real
runner in another process must, and checks it against the scheduler's requests."""

from __future__ import annotations

import pickle

from pagedkv.config import EngineConfig
from pagedkv.core.build import build_scheduler
from pagedkv.core.request import Request
from pagedkv.core.runner_io import ModelRunnerOutput, SampledTokens, SchedulerOutput
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.core.scheduler import Scheduler
from pagedkv.kv.groups import FullAttentionSpec, KVCacheGroup
from pagedkv.kv.manager import KVCacheManager

BS = 4


class FakeRunner:
    """Samples token ``1000 + position`` for every request whose chunk reaches its end."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, tuple[list[int], ...]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            self.blocks[new.req_id] = tuple(list(g) for g in new.block_ids)
        c = out.scheduled_cached_reqs
        for rid, toks, blocks in zip(c.req_ids, c.new_token_ids, c.new_block_ids):
            self.tokens[rid].extend(toks)
            for table, added in zip(self.blocks[rid], blocks):
                table.extend(added)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            assert self.tokens[rid] == req.all_token_ids  # the deltas rebuilt the request exactly
            assert self.blocks[rid] == self.scheduler.kv_manager.get_block_ids(rid)
            start = _start(out, rid)
            if start + n == len(self.tokens[rid]):
                sampled[rid] = SampledTokens([1000 + start + n])
        return ModelRunnerOutput(sampled=sampled)


def _start(out: SchedulerOutput, rid: str) -> int:
    for new in out.scheduled_new_reqs:
        if new.req_id == rid:
            return new.num_computed_tokens
    c = out.scheduled_cached_reqs
    return c.num_computed_tokens[c.req_ids.index(rid)]


def make(num_blocks=8, budget=16, max_seqs=4, prefix=True, groups=None) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, BS, prefix, kv_groups=groups)
    s = build_scheduler(EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv, max_model_len=64,
                        eos_token_ids=frozenset({2}))
    return s, FakeRunner(s)


def req(rid: str, n: int, max_tokens: int = 4, first: int = 100, **params) -> Request:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(rid, list(range(first, first + n)), p, max_tokens=max_tokens, arrival_time=0.0)


def step(s: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list]:
    out = s.schedule()
    result = runner.execute(out)
    return out, s.update(out, result, now=1.0)


def test_chunked_prefill_then_decode_exact_outputs():
    s, runner = make(budget=8)
    s.add(req("a", 10))
    out, outs = step(s, runner)
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [("a", ([1, 2],), 0)]
    assert out.num_scheduled_tokens == {"a": 8} and not outs
    out, outs = step(s, runner)  # the last 2 prompt tokens: a cached request's delta
    c = out.scheduled_cached_reqs
    assert (c.req_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens) == (["a"], [[]], [([3],)], [8])
    assert out.num_scheduled_tokens == {"a": 2}
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("a", [1010])]
    out, outs = step(s, runner)  # decode: the sampled token is the delta; no new page
    c = out.scheduled_cached_reqs
    assert (c.new_token_ids, c.new_block_ids, c.num_computed_tokens) == ([[1010]], [([],)], [10])
    out, outs = step(s, runner)  # position 11 still in page 3; position 12 opens page 4 next
    out, outs = step(s, runner)
    assert out.scheduled_cached_reqs.new_block_ids == [([4],)]
    assert outs[0].finish_reason == "length" and outs[0].new_token_ids == [1013]
    assert s.requests == {} and s.kv_manager.usage().used == 0
    assert s.schedule().finished_req_ids == ["a"]  # the runner is told once, next step


def test_budget_shared_running_first_then_waiting_in_order():
    s, runner = make(budget=6)
    s.add(req("a", 3))
    s.add(req("b", 5, first=200))
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 3, "b": 3}  # b's prefill is chunked by the budget
    out, _ = step(s, runner)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 2)]


def test_max_num_seqs_limits_admission():
    s, runner = make(max_seqs=1)
    s.add(req("a", 2))
    s.add(req("b", 2, first=200))
    out, _ = step(s, runner)
    assert list(out.num_scheduled_tokens) == ["a"] and [r.request_id for r in s.waiting] == ["b"]


def test_preemption_takes_the_newest_running_request_and_resends_it_in_full():
    s, runner = make(num_blocks=3, budget=16, prefix=False)
    for rid, first in (("a", 100), ("b", 200), ("c", 300)):
        s.add(req(rid, 4, max_tokens=6, first=first))
    out, _ = step(s, runner)  # one page each
    assert [n.block_ids for n in out.scheduled_new_reqs] == [([1],), ([2],), ([3],)]
    out, _ = step(s, runner)  # a needs a 2nd page: c (newest) is preempted, then b
    assert out.preempted_req_ids == ["c", "b"]
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_cached_reqs.new_block_ids == [([3],)]
    assert [r.request_id for r in s.waiting] == ["b", "c"] and s.num_preemptions == 2
    assert s.requests["c"].num_computed_tokens == 0
    while "a" in s.requests:
        step(s, runner)
    out, _ = step(s, runner)  # b comes back as a new request: prompt + its sampled token
    new = out.scheduled_new_reqs[0]
    assert (new.req_id, new.token_ids, new.num_computed_tokens) == ("b", list(range(200, 204)) + [1004], 0)


def test_prefix_hit_sets_the_chunk_start_and_pins_shared_pages():
    s, runner = make()
    s.add(req("a", 9, max_tokens=1))
    while s.has_unfinished:
        step(s, runner)
    s.add(req("b", 10, max_tokens=2))  # shares a's first 8 tokens = 2 full pages
    out, _ = step(s, runner)
    new = out.scheduled_new_reqs[0]
    assert (new.block_ids[0][:2], new.num_computed_tokens, out.num_scheduled_tokens) == ([1, 2], 8, {"b": 2})
    assert s.kv_manager.pool.ref_cnt[1] == 1 and s.requests["b"].num_cached_tokens == 8


def test_stop_rules_by_id_in_update():
    s, runner = make()
    s.add(req("eos", 3, max_tokens=10))
    s.add(req("stop", 3, max_tokens=10, first=300, stop_token_ids=[1003]))
    runner_out = {"eos": 2, "stop": 1003}
    out = s.schedule()
    runner.execute(out)
    outs = s.update(out, ModelRunnerOutput({r: SampledTokens([t]) for r, t in runner_out.items()}), now=2.0)
    assert [(o.request_id, o.finish_reason, o.stop_reason, o.token_time) for o in outs] == [
        ("eos", "stop", None, 2.0), ("stop", "stop", 1003, 2.0)]


def test_a_failed_row_ends_only_its_request():
    s, runner = make()
    s.add(req("a", 3))
    s.add(req("b", 3, first=200))
    out = s.schedule()
    runner.execute(out)
    outs = s.update(out, ModelRunnerOutput({"a": SampledTokens([], error="non-finite logits"),
                                            "b": SampledTokens([7])}), now=0.5)
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [
        ("a", "abort", "non-finite logits"), ("b", None, None)]
    assert list(s.requests) == ["b"]


def test_two_groups_get_their_own_tables_from_one_pool():
    groups = (KVCacheGroup(FullAttentionSpec(BS), (0,)), KVCacheGroup(FullAttentionSpec(BS), (1,)))
    s, runner = make(num_blocks=8, groups=groups)
    s.add(req("a", 6))
    out, _ = step(s, runner)
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2], [3, 4])
    s.add(req("b", 6, first=500))
    out, _ = step(s, runner)
    assert out.scheduled_new_reqs[0].block_ids == ([5, 6], [7, 8])
    assert out.scheduled_cached_reqs.new_block_ids == [([], [])]


def test_outputs_pickle():
    s, runner = make(budget=8)
    s.add(req("a", 10, logprobs=2, seed=3))
    out = s.schedule()
    result = runner.execute(out)
    assert pickle.loads(pickle.dumps(out)) == out
    assert pickle.loads(pickle.dumps(result)) == result


def _prio(rid: str, n: int, priority: int, arrival: float, first: int = 100) -> Request:
    r = req(rid, n, first=first)
    r.priority, r.arrival_time = priority, arrival
    return r


def test_priority_policy_admits_lower_values_first_and_preempts_the_highest():
    kv = KVCacheManager(3, BS, False)
    s = build_scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=4, scheduling_policy="priority"), kv,
                        max_model_len=64)
    runner = FakeRunner(s)
    s.add(_prio("late-low", 4, 5, 0.0))
    s.add(_prio("urgent", 2, -1, 1.0, first=200))
    s.add(_prio("normal", 2, 0, 2.0, first=300))
    assert [r.request_id for r in s.waiting] == ["urgent", "normal", "late-low"]
    out, _ = step(s, runner)  # budget 4: urgent (2) + normal (2); late-low waits
    assert list(out.num_scheduled_tokens) == ["urgent", "normal"]
    out, _ = step(s, runner)  # decodes + late-low's first 2 tokens
    assert out.num_scheduled_tokens == {"urgent": 1, "normal": 1, "late-low": 2}
    s.requests["urgent"].priority = 9  # now the least urgent: served last, first to go
    out, _ = step(s, runner)
    assert list(out.num_scheduled_tokens.items()) == [("normal", 1), ("late-low", 2), ("urgent", 1)]
    out, _ = step(s, runner)  # every request needs a 2nd page and none is free
    assert out.preempted_req_ids == ["urgent", "late-low"] and out.num_scheduled_tokens == {"normal": 1}
    assert [r.request_id for r in s.waiting] == ["late-low", "urgent"]  # by priority again


def test_fcfs_policy_keeps_arrival_order_whatever_the_priority():
    s, runner = make()
    s.add(_prio("a", 2, 5, 0.0))
    s.add(_prio("b", 2, -1, 1.0, first=200))
    out, _ = step(s, runner)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
