"""SimEngine: the engine's own scheduler and KV cache manager, with the runner and clock
swapped for a cost model and a virtual clock.

Everything above the runner is the engine's code, unchanged: the :class:`Scheduler`
(admission, chunked prefill, preemption, prefix caching), the :class:`KVCacheManager`
and its groups (paged, contiguous or sliding-window), the admission checks
(:func:`~pagedkv.core.admission.resolve_max_tokens`) and ``max_model_len``'s cap by
the cache (:func:`~pagedkv.core.limits.cache_max_model_len`). It offers the part of
:class:`~pagedkv.engine.engine.LLMEngine`'s interface the benchmark driver uses
(``add_request``, ``step``, ``abort_request``, ``scheduler``, ``kv_manager``), on token ids only:
no tokenizer, no weights, no tensors.

Speculative decoding runs the scheduler's own draft handling (verification, lookahead
slots, giving back rejected positions) with accepted counts drawn at a given rate
(:mod:`pagedkv.sim.spec`). SnapKV/H2O evict at the engine's points, keeping as many tokens
as the budget says (which ones a scorer picks changes no page count;
:class:`~pagedkv.sim.runner.SimRunner`). The CPU and disk KV tiers and swap preemption run
the engine's tier bookkeeping with copies priced over the host link and at the NVMe rates
(:mod:`pagedkv.sim.tier`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.config.engine import EngineConfig
from pagedkv.core.admission import resolve_max_tokens
from pagedkv.core.build import build_scheduler
from pagedkv.core.engine_core import EngineCore
from pagedkv.core.kv_layout import kv_groups
from pagedkv.core.limits import cache_max_model_len, check_streaming, resolve_max_model_len, step_tokens
from pagedkv.core.preemption import PreemptionCost
from pagedkv.core.request import Request
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.kv.manager import KVCacheManager
from pagedkv.model.config import ModelConfig
from pagedkv.planner.roofline import ModelCost
from pagedkv.sim.clock import VirtualClock
from pagedkv.sim.runner import SimRunner
from pagedkv.sim.tier import sim_tier


@dataclass(slots=True)
class SimOutput:
    """A request's state after a step: its output token ids so far (the live list: read, do
    not keep), whether it ended."""
    request_id: str
    token_ids: list[int]
    finished: bool


class SimEngine:
    """One simulated engine.

    Args:
        config: the engine flags (its ``model`` field is not read: ``model`` is).
        model: the model's shape (:func:`pagedkv.planner.models.load_model`).
        num_blocks: KV pages in the pool (the planner's ``num_blocks`` for the budget).
        cost: the model's cost (its matmul sizes price ``--preemption-mode`` decisions).
        runner: a :class:`~pagedkv.sim.runner.SimRunner` on ``clock``; with
            ``kv_offload_memory``, made with the tiers' worker (:func:`~pagedkv.sim.tier.sim_tier_worker`).
        clock: the virtual clock, shared with the runner.
        connector: a KV connector for the engine (e.g. a decode instance's remote prefill).

    Raises:
        ValueError: a setting the simulator does not model, or one the engine refuses.
    """

    def __init__(self, config: EngineConfig, model: ModelConfig, num_blocks: int, cost: ModelCost,
                 runner: SimRunner, clock: VirtualClock, connector=None) -> None:
        check_streaming(config, model)
        self.config, self.model_config, self.clock = config, model, clock
        max_len = resolve_max_model_len(model, config.max_model_len, config.kv_eviction == "streaming")
        keys = (("model", model.name), ("kv_dtype", config.kv_cache_dtype), ("block_size", str(config.block_size)))
        speculative = config.speculative_config
        if speculative is not None and runner.spec_draws is None:
            raise ValueError("speculative decoding is simulated at a given draft acceptance rate "
                             "(--spec-acceptance-rate, accepted / drafted as pagedkv bench reports it)")
        has_draft = speculative is not None and speculative.method == "draft_model"
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, keys,
                                         kv_groups(config, model, has_draft))
        self.max_model_len = cache_max_model_len(config, self.kv_manager, max_len)
        self.connector = connector  # e.g. a decode instance's remote prefill (pagedkv.sim.disagg)
        if config.kv_offload_memory is not None:
            if runner.tier is None:
                raise ValueError("a simulated KV tier needs the runner's tier worker (sim_tier_worker)")
            self.connector = sim_tier(self.kv_manager, config, runner.tier)
        preemption = PreemptionCost(config.preemption_mode, cost.layer_matmul_params, cost.attn_flops_per_pair)
        scheduler = build_scheduler(config, self.kv_manager, self.max_model_len,
                                    connector=self.connector.scheduler if self.connector else None,
                                    preemption=preemption)
        self.core = EngineCore(scheduler, runner, clock=clock, debug_invariants=config.debug_invariants)
        self._live: dict[str, Request] = {}
        self._next_id = 0
        self.num_rejected = 0

    scheduler = property(lambda self: self.core.scheduler)
    runner = property(lambda self: self.core.runner)
    peak_blocks_used = property(lambda self: self.core.peak_blocks_used)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> Request:
        """Queue a request of token ids (``{"prompt_token_ids": [...]}`` or a list).

        Raises:
            ValueError: no token ids, or a request that can never fit (as the engine says).
        """
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        params = params or SamplingParams()
        try:
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError("a simulated prompt is a non-empty list of token ids")
            max_tokens = resolve_max_tokens(self.kv_manager, self.max_model_len, step_tokens(self.config), len(ids),
                                            params, self.config.kv_eviction == "streaming",
                                            self.scheduler.eviction)
        except ValueError:
            self.num_rejected += 1
            raise
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1  # (the engine's ids)
        req = Request(request_id, list(ids), params, max_tokens=max_tokens, arrival_time=arrival_time,
                      priority=priority)
        self.core.add_request(req)
        self._live[request_id] = req
        return req

    def step(self) -> list[SimOutput]:
        return [self._output(o.request_id, o.finished) for o in self.core.step()]

    def abort_request(self, request_id: str) -> SimOutput | None:
        outs = self.core.abort_requests([request_id])
        return self._output(request_id, True) if outs else None

    def _output(self, request_id: str, finished: bool) -> SimOutput:
        req = self._live[request_id]
        if finished:
            del self._live[request_id]
        return SimOutput(request_id, req.output_token_ids, finished)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        return self.kv_manager.reset_prefix_cache()
