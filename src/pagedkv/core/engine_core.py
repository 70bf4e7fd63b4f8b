"""EngineCore: token ids in, token ids out; a scheduler, a runner and a clock, all injected.

    core = EngineCore(scheduler, runner, clock=time.perf_counter)
    core.add_request(Request("r1", [1, 2, 3], SamplingParams(max_tokens=8)))
    while core.has_unfinished_requests():
        for out in core.step():          # EngineCoreOutput: new token ids, finish reason
            ...

No tokenizer and no wall clock of its own: the text side (:class:`~pagedkv.engine.engine.LLMEngine`)
wraps it with tokenization, stop strings and incremental detokenization; the simulator
passes a cost-model runner and a virtual clock. A runner is anything with
``execute(SchedulerOutput) -> ModelRunnerOutput``.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Protocol

from pagedkv.core.core_output import EngineCoreOutput
from pagedkv.core.request import Request
from pagedkv.core.runner_io import ModelRunnerOutput, SchedulerOutput
from pagedkv.core.scheduler import Scheduler


class Runner(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """One scheduler and one runner, stepped together.

    Args:
        scheduler: owns requests and pages.
        runner: computes a step (the model, a cost model, or workers in other processes).
        clock: seconds, read when a request arrives and after each step (default
            ``time.perf_counter``; the simulator's virtual clock advances by its cost model).
        debug_invariants: check the KV manager's invariants after every step.
    """

    def __init__(self, scheduler: Scheduler, runner: Runner, clock: Callable[[], float] = time.perf_counter,
                 debug_invariants: bool = False) -> None:
        self.scheduler, self.runner, self.clock = scheduler, runner, clock
        self.debug_invariants = debug_invariants
        self.peak_blocks_used = 0
        self.num_steps = 0
        self.failed_outputs: list[EngineCoreOutput] = []  # the requests a failed step ended
        #: the last step's plan, and the pool's pages in use right after it was made (before
        #: requests that end in the step free theirs): what a benchmark records per step
        self.last_scheduled: SchedulerOutput | None = None
        self.last_scheduled_blocks = 0

    def add_request(self, req: Request) -> None:
        """Queue ``req`` (its arrival time is the clock's now unless already set)."""
        if self.scheduler.is_id_in_use(req.request_id):
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.arrival_time is None:
            req.arrival_time = self.clock()
        self.scheduler.add(req)

    def abort_requests(self, request_ids: Iterable[str], reason: str = "abort") -> list[EngineCoreOutput]:
        """End the given live requests and free their pages; unknown ids are ignored."""
        outs = []
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish(rid, reason)
                outs.append(EngineCoreOutput.of(req, [], []))
        return outs

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or ended ones whose pages a KV connector still reads
        (stepping on lets the connector report them done)."""
        return self.scheduler.has_unfinished or self.scheduler.num_delayed_free > 0

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute and apply one step; an output per request that got tokens.

        If the runner raises, the step's requests are aborted (their KV writes are
        incomplete) and the error propagates; the engine stays usable.
        """
        sched = self.last_scheduled = self.scheduler.schedule()
        self.last_scheduled_blocks = self.scheduler.kv_manager.pool.num_used
        if not (sched.num_scheduled_tokens or sched.finished_req_ids or sched.preempted_req_ids
                or self.scheduler.num_delayed_free or sched.kv_connector_metadata is not None):
            return []  # (a connector's plan always runs: it may hold pins until reported)
        self._note_peak()  # before the step: requests that end in it free their pages in update
        try:
            result = self.runner.execute(sched)
        except Exception as e:
            reqs = [self.scheduler.requests[rid] for rid in sched.req_ids]
            for r in reqs:
                r.error = f"the engine step failed: {type(e).__name__}: {e}"
            self.scheduler.step_failed(sched)
            self.failed_outputs = [EngineCoreOutput.of(r, [], []) for r in reqs]
            raise
        outputs = self.scheduler.update(sched, result, self.clock())
        self.num_steps += 1
        self._after_step()
        return outputs

    def connector_step(self) -> None:
        """A step that computes nothing and lets the KV connector move what it has pending
        (e.g. disk writes of the blocks the last step saved) and report what ended. No
        request is scheduled or changed."""
        sched = self.scheduler
        if sched.connector is None:
            return
        out = SchedulerOutput()
        out.kv_connector_metadata = sched.connector.build_connector_meta(out)
        sched.update(out, self.runner.execute(out), self.clock())

    def _note_peak(self) -> None:
        self.peak_blocks_used = max(self.peak_blocks_used, self.scheduler.kv_manager.pool.num_used)

    def _after_step(self) -> None:
        self._note_peak()
        if self.debug_invariants:
            self.scheduler.kv_manager.check_invariants()
            if self.scheduler.connector is not None:
                self.scheduler.connector.check_invariants()
