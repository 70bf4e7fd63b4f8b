"""EngineCore with injected parts: a cost-model runner on a virtual clock drives a whole
workload without weights; a toy second KV group runs the real (tiny) model and gives the
same tokens and log-probs as one group."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.config.engine import EngineConfig
from pagedkv.core.build import build_scheduler
from pagedkv.core.engine_core import EngineCore
from pagedkv.core.request import Request
from pagedkv.core.runner_io import ModelRunnerOutput, SampledTokens, SchedulerOutput
from pagedkv.engine.parts import build_parts
from pagedkv.kv.groups import FullAttentionSpec, KVCacheGroup
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv_cache.storage import KVCacheStorage
from pagedkv.worker.model_runner import ModelRunner


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostModelRunner:
    """No weights: a step costs ``fixed + per_token * tokens`` seconds on the clock and
    every sampling request gets token ``7``."""

    def __init__(self, clock: VirtualClock, fixed: float = 0.010, per_token: float = 0.001) -> None:
        self.clock, self.fixed, self.per_token = clock, fixed, per_token
        self.left: dict[str, int] = {}  # tokens of each request not yet computed
        self.steps: list[int] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for new in out.scheduled_new_reqs:
            self.left[new.req_id] = len(new.token_ids) - new.num_computed_tokens
        for rid, toks in zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.new_token_ids):
            self.left[rid] += len(toks)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            self.left[rid] -= n
            if self.left[rid] == 0:
                sampled[rid] = SampledTokens([7])
        self.steps.append(out.total_num_scheduled_tokens)
        self.clock.now += self.fixed + self.per_token * out.total_num_scheduled_tokens
        return ModelRunnerOutput(sampled=sampled)


def test_cost_model_runner_drives_a_whole_workload_on_a_virtual_clock():
    clock = VirtualClock()
    kv = KVCacheManager(num_blocks=12, block_size=4)
    runner = CostModelRunner(clock)
    core = EngineCore(build_scheduler(EngineConfig(max_num_seqs=4, max_num_batched_tokens=16), kv, max_model_len=64),
                      runner, clock, debug_invariants=True)
    for i in range(10):
        core.add_request(Request(f"r{i}", list(range(10 * i, 10 * i + 5 + i)), SamplingParams(max_tokens=6),
                                 max_tokens=6))
    finished, first_token = {}, {}
    while core.has_unfinished_requests():
        for o in core.step():
            first_token.setdefault(o.request_id, o.token_time)
            if o.finished:
                finished[o.request_id] = o
    assert sorted(finished) == sorted(f"r{i}" for i in range(10))
    assert all(o.finish_reason == "length" for o in finished.values())
    assert kv.usage().used == 0 and core.num_steps == len(runner.steps)
    # the first step prefills r0..r2 whole and 1 token of r3 (budget 16): 10 ms + 16 x 1 ms
    assert runner.steps[0] == 16 and first_token["r0"] == pytest.approx(0.026)
    assert abs(clock.now - sum(0.010 + 0.001 * n for n in runner.steps)) < 1e-9


def _two_group_core(tiny_model_dir) -> EngineCore:
    parts = build_parts(EngineConfig(model=str(tiny_model_dir), num_blocks=32, batch_invariant=True))
    groups = (KVCacheGroup(FullAttentionSpec(16), (0,)), KVCacheGroup(FullAttentionSpec(16), (1,)))
    kv = KVCacheManager(32, 16, True, parts.kv_manager.extra_keys, groups)
    storage = KVCacheStorage(parts.kv_spec, kv.pool.num_pages)
    runner = ModelRunner(parts.model, storage, groups, torch.Generator().manual_seed(0))
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=24)
    return EngineCore(build_scheduler(config, kv, parts.max_model_len, parts.eos_token_ids), runner,
                      debug_invariants=True)


def test_a_second_kv_group_gives_the_same_tokens_and_logprobs(tiny_model_dir):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [list(range(300, 300 + n)) for n in (5, 16, 17, 40)]
    llm = LLM(model=str(tiny_model_dir), num_blocks=32, batch_invariant=True, max_num_batched_tokens=24)
    want = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    core = _two_group_core(tiny_model_dir)
    got = {f"r{i}": ([], []) for i in range(len(prompts))}
    for rounds in range(2):  # the second round hits the prefix cache in both groups
        for i, p in enumerate(prompts):
            core.add_request(Request(f"r{i}", p, params, max_tokens=8))
        got = {f"r{i}": ([], []) for i in range(len(prompts))}
        while core.has_unfinished_requests():
            for o in core.step():
                got[o.request_id][0].extend(o.new_token_ids)
                got[o.request_id][1].extend(o.new_logprobs)
        for i, w in enumerate(want):
            assert got[f"r{i}"] == (w.token_ids, w.logprobs), f"prompt {i}, round {rounds}"
    kv = core.scheduler.kv_manager
    assert kv.prefix_hits > 0 and kv.usage().used == 0
