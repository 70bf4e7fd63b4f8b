"""Drive an :class:`LLMEngine` through a workload, one ``step()`` at a time, and record it.

Composed around the engine, not inside it: arrivals are injected by time between steps
(``add_request``, then the request's ``arrival_time`` is set to its scheduled arrival so
TTFT counts the wait for the step in flight); each step's ``SchedulerOutput`` (tokens,
contexts: the roofline work) is read from ``EngineCore.last_scheduled``; after every step
the driver samples ``kv_manager.slot_usage`` (KV waste), blocks in use and the number of
running requests. A request whose ``output_len`` is below its ``max_tokens``
is ended by the driver when it reaches ``output_len`` (an EOS at the data's reply length);
its pages are freed at once, as a stop would, and its finish reason is ``length``.

    engine = LLMEngine(EngineConfig(kv_cache_memory="128MiB"))
    run = drive(engine, workload)
    run.metrics()   # throughput, latency percentiles, waste, peak blocks, max running
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from pagedkv.bench.metrics import RequestRecord, WasteSamples, summarize_requests
from pagedkv.bench.workloads import BenchRequest
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.planner.roofline import StepWork, chunk_work


@dataclass
class EngineRun:
    """Everything one driven run recorded. Times are seconds."""
    records: list[RequestRecord]
    steps: list[StepWork]
    step_seconds: list[float]
    running: list[int]            # requests scheduled in each step
    blocks_used: list[int]        # after each step
    waste: WasteSamples
    duration_s: float
    bookkeeping_s: float          # the driver's own sampling time, inside duration_s
    preemptions: int
    num_blocks: int
    prefix_hit_tokens: int
    extra: dict = field(default_factory=dict)
    step_starts: list[float] = field(default_factory=list)  # clock at each step's start, from t0
    running_after: list[int] = field(default_factory=list)  # requests running after each step
    waiting: list[int] = field(default_factory=list)        # requests waiting after each step
    idle_after: list[bool] = field(default_factory=list)    # the driver waited for an arrival after each step
    scheduled_blocks_peak: int = 0  # most blocks in use right after a step was scheduled (before it freed any)

    def metrics(self) -> dict:
        m = summarize_requests(self.records, self.duration_s)
        prefill = sum(s.tokens for s in self.steps) - sum(max(0, r.num_output_tokens - 1) for r in self.records)
        return m | self.waste.summary() | {
            "preemptions": self.preemptions, "num_blocks": self.num_blocks,
            "peak_kv_blocks": max(self.blocks_used + [self.scheduled_blocks_peak]),
            "max_running": max(self.running, default=0),
            "mean_running": sum(self.running) / len(self.running) if self.running else 0,
            "steps": len(self.steps), "prefill_tokens_computed": prefill,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "step_s_median": sorted(self.step_seconds)[len(self.step_seconds) // 2] if self.step_seconds else None,
            "bookkeeping_s": self.bookkeeping_s} | self.extra


def sampling_params(r: BenchRequest, ignore_eos: bool) -> SamplingParams:
    """Greedy, ``max_tokens`` as reserved; EOS ignored so every system does the same work."""
    return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=ignore_eos)


def warm_up(engine) -> None:
    """One short request through the engine (thread pools, first-call costs), then forget it."""
    engine.add_request({"prompt_token_ids": [1, 2, 3, 4]}, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def drive(engine, workload: list[BenchRequest], ignore_eos: bool = True, sample_waste: bool = True,
          on_step: Callable[[int, int], None] | None = None, clock: Callable[[], float] = time.perf_counter,
          sleep: Callable[[float], None] = time.sleep) -> EngineRun:
    """Run ``workload`` (arrivals by ``arrival_s``) to completion on ``engine``.

    ``on_step(finished, total)`` is called after each step (a progress bar). ``clock``
    (seconds) and ``sleep`` are the wall clock, or the simulator's virtual clock
    (:class:`pagedkv.sim.clock.VirtualClock`), which must be the engine core's too.
    Raises:
        ValueError: if the engine rejects a request (too long for it).
    """
    order = sorted(enumerate(workload), key=lambda x: x[1].arrival_s)
    return _loop(engine, order, ignore_eos, sample_waste, on_step, clock, sleep)


def _loop(engine, pending: list[tuple[int, BenchRequest]], ignore_eos, sample_waste, on_step, clock,
          sleep) -> EngineRun:
    kv, sched, core = engine.kv_manager, engine.scheduler, engine.core
    preempt0, hits0 = sched.num_preemptions, kv.prefix_hits
    run = EngineRun([], [], [], [], [], WasteSamples(), 0.0, 0.0, 0, kv.pool.num_blocks, 0)
    targets: dict[str, tuple[int, object, int]] = {}
    total, i = len(pending), 0
    t0 = clock()
    while i < total or engine.has_unfinished_requests():
        now = clock() - t0
        while i < total and pending[i][1].arrival_s <= now:
            index, r = pending[i]
            req = engine.add_request({"prompt_token_ids": list(r.prompt_token_ids)}, sampling_params(r, ignore_eos),
                                     arrival_time=t0 + r.arrival_s)
            targets[req.request_id] = (r.output_len, req, index)
            i += 1
        if not engine.has_unfinished_requests():
            if run.idle_after:
                run.idle_after[-1] = True
            sleep(max(0.0, pending[i][1].arrival_s - (clock() - t0)))
            continue
        run.step_starts.append(now)
        ts = clock()
        outs = engine.step()
        run.step_seconds.append(clock() - ts)
        run.idle_after.append(False)
        tb = clock()
        run.scheduled_blocks_peak = max(run.scheduled_blocks_peak, core.last_scheduled_blocks)
        _record_step(run, core.last_scheduled, kv, sched, sample_waste, sum(1 for o in outs if o.token_ids))
        for out in outs:
            target, req, index = targets[out.request_id]
            if not out.finished and len(out.token_ids) >= target:
                engine.abort_request(out.request_id)
                req.finish_reason = "length"
            if out.finished or len(out.token_ids) >= target:
                run.records.append(_record(req, index))
        run.bookkeeping_s += clock() - tb
        if on_step:
            on_step(len(run.records), total)
    run.duration_s = clock() - t0
    run.preemptions = sched.num_preemptions - preempt0
    run.prefix_hit_tokens = kv.prefix_hits - hits0
    return run


def _record_step(run: EngineRun, out, kv, sched, sample_waste: bool, num_sampled: int) -> None:
    if out is not None and out.num_scheduled_tokens:
        chunks = out.chunks()
        run.steps.append(chunk_work([(start, n) for _, start, n in chunks], num_sampled))
        run.running.append(len(chunks))
    run.blocks_used.append(kv.pool.num_used)
    run.running_after.append(len(sched.running))
    run.waiting.append(len(sched.waiting))
    if sample_waste:
        run.waste.add(*kv.slot_usage({r.request_id: r.num_computed_tokens for r in sched.running}))


def _record(req, index: int) -> RequestRecord:
    return RequestRecord(req.arrival_time, req.num_prompt_tokens, list(req.token_times),
                         max(req.num_cached_tokens, 0), req.num_preemptions, req.finish_reason,
                         index, list(req.output_token_ids))
