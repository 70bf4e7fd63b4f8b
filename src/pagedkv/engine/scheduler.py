"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step, under a token budget (``max_num_batched_tokens``):

1. running requests, oldest first, get ``num_tokens - num_computed_tokens`` tokens (1 for a
   decode, a chunk for an unfinished prefill). When pages run out, the most recently
   admitted running request is preempted: its pages are freed, its progress reset, and
   it goes back to the front of the waiting queue (its tokens are recomputed later).
2. if nothing was preempted, waiting requests are admitted in order while the budget,
   ``max_num_seqs`` and the pool allow. The prefix lookup comes first; the tokens to
   schedule are derived from its hit, then the pages are allocated.

The same code drives the real model runner and the simulator.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedkv.engine.request import Request, RequestStatus
from pagedkv.kv.manager import KVCacheManager


@dataclass
class ScheduledRequest:
    """``num_new_tokens`` tokens of ``request`` from position ``start`` are computed this step."""
    request: Request
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so a token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting and running queues; the KV manager owns the pages."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return budget
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - req.num_computed_tokens - hit.num_tokens, budget)
            if not self.kv.allocate_slots(req, n, hit):
                break
            self.waiting.popleft()
            req.num_computed_tokens += hit.num_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))
            budget -= n

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput) -> None:
        """Advance progress after the runner wrote this step's KV; publish full blocks."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.request, s.request.num_computed_tokens)

    def finish(self, req: Request, reason: str) -> None:
        """End ``req`` (``stop``, ``length`` or ``abort``) and free its pages. Idempotent."""
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
