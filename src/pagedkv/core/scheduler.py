"""Scheduler: continuous batching with chunked prefill and preemption (recompute or swap).

Each step, under a token budget (``max_num_batched_tokens``):

1. running requests, oldest first, get ``num_tokens - num_computed_tokens`` tokens (1 for a
   decode, a chunk for an unfinished prefill). When pages run out, the most recently
   admitted running request is preempted: its pages are freed, its progress reset, and
   it goes back to the front of the waiting queue (its tokens are recomputed later, or,
   with ``preemption_mode`` swap/auto, its KV is first copied to the KV connector's tier
   and found there on resume: :mod:`pagedkv.core.preemption`).
   A decoding request with draft tokens (speculative decoding) gets ``1 + len(drafts)``;
   drafts that cannot get pages are shortened, never preempting anyone. With a draft
   model, a request that samples also gets up to k lookahead slots for the KV of the
   drafts it proposes next (shortened first). After verification its progress drops past
   the rejected drafts, and pages past its committed tokens, one more and the lookahead
   go back to the pool at once.
2. if nothing was preempted, waiting requests are admitted in order while the budget,
   ``max_num_seqs`` and the pool allow. The prefix lookup (local cache, then the KV
   connector) comes first; the tokens to schedule are derived from its hit, then the
   pages are allocated.

With score-based KV eviction (:mod:`pagedkv.core.kv_eviction`), a long prompt's chunks are
cut so its observation window runs in its last chunk; the runner answers with the tokens to
keep, and the request is compacted the next time it is scheduled (the runner copies the
kept KV before that step's forward).

The scheduler is the only writer of request state. ``schedule`` returns a plain-data
:class:`~pagedkv.core.runner_io.SchedulerOutput`; ``update`` applies the runner's
:class:`~pagedkv.core.runner_io.ModelRunnerOutput` (progress, published pages, sampled
tokens, stop checks by token id). The same code drives the real model runner and the
simulator's cost model.
"""

from __future__ import annotations

from collections import deque

from pagedkv.connectors.base import KVConnectorScheduler
from pagedkv.core.core_output import EngineCoreOutput, check_stop
from pagedkv.core.kv_eviction import KVEvictionPolicy
from pagedkv.core.preemption import PreemptionCost
from pagedkv.core.request import Request, RequestStatus
from pagedkv.core.runner_io import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedkv.core.scheduler_stats import SchedulerStats
from pagedkv.core.scheduling_policy import SCHEDULING_POLICY_MAP
from pagedkv.core.spec_decode_stats import SpecDecodeStats
from pagedkv.kv.manager import KVCacheManager


class Scheduler:
    """Owns the waiting and running queues; the KV manager owns the pages. Made by
    :func:`pagedkv.core.build.build_scheduler` from an engine config.

    Args:
        kv_manager: the KV cache manager (pages and block tables).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step.
        max_model_len: a request stops (``length``) when it reaches this many tokens.
        eos_token_ids: ids that end a request unless its params say ``ignore_eos``.
        connector: the scheduler side of a KV connector, or None.
        policy: ``fcfs`` or ``priority`` (:mod:`pagedkv.core.scheduling_policy`).
        preemption: swap-or-recompute pricing (:mod:`pagedkv.core.preemption`); None:
            always recompute.
        num_speculative_tokens: drafts per step when speculative decoding is on (0: off);
            sizes the per-position counters.
        num_lookahead_tokens: slots past a sampling request's tokens to allocate for a draft
            model's proposals (their KV is written before they are verified); shortened,
            never preempting, when pages are short. 0 for n-gram drafts.
        eviction: score-based KV eviction with compaction (:mod:`pagedkv.core.kv_eviction`),
            or None.
    """

    def __init__(self, *, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None, eos_token_ids: frozenset[int], connector: KVConnectorScheduler | None,
                 policy: str, preemption: PreemptionCost | None, num_speculative_tokens: int,
                 num_lookahead_tokens: int, eviction: KVEvictionPolicy | None) -> None:
        self.kv_manager = kv_manager
        self.eviction = eviction
        self.num_tokens_evicted = 0      # KV eviction: tokens dropped from requests' caches
        self.blocks_freed_by_eviction = 0
        self._compactions: dict[str, list[int]] = {}  # compacted since the runner last saw them
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.connector = connector
        self.policy = SCHEDULING_POLICY_MAP[policy]()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.preemption = preemption
        self.spec_stats = SpecDecodeStats(num_speculative_tokens) if num_speculative_tokens else None
        self._trimmed: set[str] = set()  # requests whose tables shrank since the runner last saw them
        self.num_kv_load_failures = 0
        # what the runner holds of each request it has seen: (tokens, pages per group), or
        # None after a preemption (it keeps only the request's generator then)
        self._sent: dict[str, tuple[int, list[int]] | None] = {}
        self._finished_ids: list[str] = []                  # to tell the runner next step
        self._delayed_free: set[str] = set()                # pages kept until the connector is done

    def stats(self) -> SchedulerStats:
        """A snapshot of the queues and the scheduler's counters."""
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_preemptions=self.num_preemptions,
            preemptions_by_mode=dict(self.preemptions_by_mode),
            spec_decode=self.spec_stats.to_dict() if self.spec_stats is not None else None,
            tokens_evicted=self.num_tokens_evicted, blocks_freed_by_eviction=self.blocks_freed_by_eviction,
            num_kv_load_failures=self.num_kv_load_failures,
            connector=self.connector.get_stats() if self.connector is not None else None)

    def cap_step_tokens(self, max_num_batched_tokens: int) -> None:
        """Lower the token budget of every later step (a server draining for shutdown)."""
        self.max_num_batched_tokens = min(self.max_num_batched_tokens, max_num_batched_tokens)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.policy.add(self.waiting, req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.policy.order_running(self.running)
        i, evicting, lookahead = 0, self.eviction is not None, self.num_lookahead_tokens
        while i < len(self.running) and budget > 0:  # (once per request and step: written for speed)
            req = self.running[i]
            n = min(len(req.all_token_ids) - req.num_computed_tokens, budget)
            if evicting:
                n = self.eviction.chunk(req, req.num_computed_tokens, n)
            if n == 0:  # its observation window waits for a step with room for all of it
                i += 1
                continue
            while req.kv_keep is not None and not self._compact(req):  # pages short: preempt, as below
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    return budget
            drafts = self._drafts(req, n, budget) if req.spec_token_ids else []
            ends = req.num_computed_tokens + n == req.num_tokens
            look = self._lookahead(req, n + len(drafts), ends) if lookahead else 0
            while not self.kv_manager.allocate_slots(req, n + len(drafts) + look):
                if look or drafts:  # lookahead, then drafts, are shortened, never preempting others
                    look, drafts = (look - 1, drafts) if look else (0, drafts[:-1])
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    return budget
            self._emit(out, req, n + len(drafts))
            if drafts:
                out.scheduled_spec_decode_tokens[req.request_id] = drafts
            budget -= n + len(drafts)
            i += 1
        return budget

    def _chunk(self, req: Request, start: int, n: int) -> int:
        return self.eviction.chunk(req, start, n) if self.eviction is not None else n

    def _compact(self, req: Request) -> bool:
        """Apply the runner's eviction choice now that ``req`` runs this step (its old pages
        are reused only by this step's writes, after the runner's copy). False, changing
        nothing, when no pages can be found (the caller preempts: a request never decodes
        past its eviction point uncompacted, so its output does not depend on the pool)."""
        keep = self.eviction.keep_after(req, *req.kv_keep)
        freed = self.kv_manager.compact(req, len(keep))
        if freed < 0:
            return False
        self.blocks_freed_by_eviction += freed
        self.num_tokens_evicted += req.num_computed_tokens - req.num_evicted_tokens - len(keep)
        req.num_evicted_tokens = req.num_computed_tokens - len(keep)
        req.kv_keep = None
        rid = req.request_id
        self._compactions[rid] = keep
        sent = self._sent[rid]
        self._sent[rid] = (sent[0], [0] * len(sent[1]))  # the runner's tables start over
        self._trimmed.add(rid)
        return True

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The request's proposed drafts that this step can verify: only for a decode (one
        token to compute), within the budget, ``max_model_len`` and its ``max_tokens``
        (the drafts plus the target's own token must not overshoot)."""
        if not req.spec_token_ids or n != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return []
        limit = min(budget - 1, req.max_tokens - len(req.output_token_ids) - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - req.num_tokens)
        return req.spec_token_ids[:max(0, limit)]

    def _lookahead(self, req: Request, num_new: int, samples: bool) -> int:
        """Lookahead slots for a request whose ``num_new`` tokens this step end its known
        tokens (so it samples and a draft model proposes after it), within ``max_model_len``."""
        if not self.num_lookahead_tokens or not samples:
            return 0
        room = (self.max_model_len if self.max_model_len is not None else 1 << 62) - req.num_computed_tokens - num_new
        return max(0, min(self.num_lookahead_tokens, room))

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv_manager.get_computed_blocks(req, self.eviction.max_hit_tokens(req) if self.eviction else None)
            external = self._external_hit(req, hit.num_tokens)
            start = req.num_computed_tokens + hit.num_tokens + external
            n = self._chunk(req, start, min(req.num_tokens - start, budget))
            ends = start + n == req.num_tokens
            look = self._lookahead(req, hit.num_tokens + external + n, ends)
            if n <= 0 or not (look and self.kv_manager.allocate_slots(req, n + external + look, hit)
                              or self.kv_manager.allocate_slots(req, n + external, hit)):
                if n > 0 and self.connector is not None:  # out of pages: ask for what the connector keeps
                    need = -(-(n + external) // self.kv_manager.block_size) - self.kv_manager.pool.num_available
                    self.connector.reclaim(max(1, need), idle=not self.running)
                break
            self.waiting.popleft()
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, self.kv_manager.get_block_ids(req.request_id), external)
            req.num_computed_tokens += hit.num_tokens + external
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens + external
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(out, req, n)
            budget -= n

    def _external_hit(self, req: Request, local_tokens: int) -> int:
        """Tokens the connector can load beyond the local hit (always leaving one to compute)."""
        if self.connector is None or req.sampling_params.prompt_logprobs is not None:
            return 0  # prompt log-probs need every prompt position computed here
        n = self.connector.get_num_new_matched_tokens(req, local_tokens)
        return max(0, min(n, req.num_tokens - 1 - local_tokens))

    def _emit(self, out: SchedulerOutput, req: Request, n: int) -> None:
        """Add ``req``'s chunk of ``n`` tokens to ``out``: in full if the runner has no
        state for it, else as a delta of tokens and pages it has not seen. (Runs once per
        request and step: written for speed.)"""
        rid, blocks = req.request_id, self.kv_manager.get_block_ids(req.request_id)
        out.num_scheduled_tokens[rid] = n
        sent = self._sent.get(rid)
        if sent is None:
            out.scheduled_new_reqs.append(NewRequestData(
                rid, list(req.all_token_ids), req.num_prompt_tokens, req.sampling_params,
                tuple(list(g) for g in blocks), req.num_computed_tokens, resumed=rid in self._sent))
            self._trimmed.discard(rid)
        else:
            seen = sent[1]
            trimmed = rid in self._trimmed
            out.scheduled_cached_reqs.add(rid, req.all_token_ids[sent[0]:],
                                          (blocks[0][seen[0]:],) if len(blocks) == 1 else
                                          tuple([g[k:] for g, k in zip(blocks, seen)]),
                                          req.num_computed_tokens, tuple(seen) if trimmed else None,
                                          self._compactions.pop(rid, None) if self._compactions else None)
            if trimmed:
                self._trimmed.discard(rid)
        self._sent[rid] = (len(req.all_token_ids), [len(g) for g in blocks])

    def _preempt(self, req: Request) -> None:
        mode = "swap" if self._swap_out(req) else "recompute"
        self.preemptions_by_mode[mode] += 1
        self.kv_manager.free(req.request_id)
        if req.request_id in self._sent:
            self._sent[req.request_id] = None  # the runner drops its pages; sent in full again
        req.num_computed_tokens = 0
        req.num_evicted_tokens, req.kv_keep = 0, None  # recomputed, scored and compacted again
        self._compactions.pop(req.request_id, None)
        req.spec_token_ids = []
        self._trimmed.discard(req.request_id)
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.policy.requeue(self.waiting, req)

    def _swap_out(self, req: Request) -> bool:
        """Whether the connector keeps ``req``'s KV through this preemption (see
        :mod:`pagedkv.core.preemption`). Prompt log-prob requests always recompute."""
        p = self.preemption
        if (p is None or p.mode == "recompute" or self.connector is None or not req.num_computed_tokens
                or req.sampling_params.prompt_logprobs is not None):
            return False
        plan = self.connector.swap_plan(req, req.num_computed_tokens)
        if p.choose(req.request_id, plan) != "swap":
            return False
        return self.connector.swap_out(req, self.kv_manager.get_block_ids(req.request_id), plan)

    # ---- update -----------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput, now: float) -> list[EngineCoreOutput]:
        """Apply one step's result: advance progress, publish full pages, append sampled
        tokens (stamped ``now``) and finish requests that hit a stop condition."""
        outputs = []
        if self.preemption is not None and self.preemption.mode == "auto":  # only auto uses the rate
            self.preemption.observe([(self.requests[r].num_computed_tokens, sched.num_scheduled_tokens[r])
                                     for r in sched.req_ids if r in self.requests], result.execute_seconds)
        spec, sampled_by, scheduled = sched.scheduled_spec_decode_tokens, result.sampled, sched.num_scheduled_tokens
        spec_ids, keep, invalid = result.spec_token_ids, result.kv_keep, result.invalid_block_ids
        cache_full_blocks = self.kv_manager.cache_full_blocks
        for rid in sched.req_ids:  # (once per request and step: written for speed)
            req = self.requests.get(rid)
            if req is None or req.status is RequestStatus.FINISHED:  # ended while the step ran
                continue
            if invalid and self._roll_back(req, invalid):
                if self.connector.load_failure_policy == "fail":
                    req.error = "loading the prompt's KV from the prefill instance failed (kv_load_failure_policy fail)"
                    self.finish(rid, "abort")
                    outputs.append(EngineCoreOutput.of(req, [], []))
                continue
            drafts = spec.get(rid, ()) if spec else ()
            sampled = sampled_by.get(rid)
            accepted = len(sampled.token_ids) - 1 if drafts and sampled is not None and sampled.token_ids else 0
            req.num_computed_tokens += scheduled[rid] - (len(drafts) - accepted)
            cache_full_blocks(req, min(req.num_computed_tokens, len(req.all_token_ids)))
            if result.prompt_logprobs:
                prompt_lp = result.prompt_logprobs.get(rid)
                if prompt_lp is not None:
                    req.add_prompt_logprobs(prompt_lp)
            if sampled is not None:
                outputs.append(self._apply_sampled(req, sampled, now))
            if drafts:
                self._after_verification(req, len(drafts), accepted)
            if req.status is not RequestStatus.FINISHED:
                if spec_ids:
                    req.spec_token_ids = spec_ids.get(rid, [])
                elif req.spec_token_ids:
                    req.spec_token_ids = []
                if keep and rid in keep:  # chosen among the tokens cached now
                    req.kv_keep = (keep[rid], req.num_computed_tokens - req.num_evicted_tokens)
        if self.connector is not None:
            self.connector.update_connector_output(result.kv_connector_output)
        self._finish_transfers(result)
        return outputs

    def _after_verification(self, req: Request, drafted: int, accepted: int) -> None:
        """Count the verification; publish blocks its accepted drafts filled; give back
        pages that held only rejected positions (the runner cuts its table next time)."""
        if self.spec_stats is not None:
            self.spec_stats.record(drafted, accepted)
        if req.is_finished:
            return
        self.kv_manager.cache_full_blocks(req, req.num_computed_tokens)
        trimmed = self.kv_manager.trim(req, req.num_computed_tokens + 1 + self.num_lookahead_tokens)
        if trimmed and req.request_id in self._sent:
            sent = self._sent[req.request_id]
            self._sent[req.request_id] = (sent[0], [min(k, len(g)) for k, g in
                                                    zip(sent[1], self.kv_manager.get_block_ids(req.request_id))])
            self._trimmed.add(req.request_id)

    def _roll_back(self, req: Request, invalid: set[int]) -> bool:
        """Load-failure policy ``recompute``: if a page of ``req`` failed to load, its
        progress goes back to the last whole block before that page and this step's
        result for it is dropped (computed from bad KV); returns whether it did."""
        tables = self.kv_manager.get_block_ids(req.request_id)
        bad = [i for table in tables for i, b in enumerate(table) if b in invalid]
        if not bad:
            return False
        req.num_computed_tokens = min(req.num_computed_tokens, min(bad) * self.kv_manager.block_size)
        req.num_cached_tokens = min(req.num_cached_tokens, req.num_computed_tokens)  # what was not loaded is computed
        self.num_kv_load_failures += 1
        return True

    def _apply_sampled(self, req: Request, sampled, now: float) -> EngineCoreOutput:
        if sampled.error is not None:  # this request alone failed to sample
            req.error = sampled.error
            self.finish(req.request_id, "abort")
            return EngineCoreOutput.of(req, [], [])
        if len(sampled.token_ids) == 1 and sampled.logprobs is None:  # (most steps: one token, no log-probs)
            tok = sampled.token_ids[0]
            req.append_token(tok, now)
            reason, stop_reason = check_stop(req, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                req.stop_reason = stop_reason
                self.finish(req.request_id, reason)
            return EngineCoreOutput.of(req, [tok], [])
        new_ids, new_lps = [], []
        for i, tok in enumerate(sampled.token_ids):
            req.append_token(tok, now)
            new_ids.append(tok)
            if sampled.logprobs is not None:
                req.logprobs.append(sampled.logprobs[i])
                new_lps.append(sampled.logprobs[i])
            reason, stop_reason = check_stop(req, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                req.stop_reason = stop_reason
                self.finish(req.request_id, reason)
                break
        return EngineCoreOutput.of(req, new_ids, new_lps)

    # ---- finish -----------------------------------------------------------------------
    def finish(self, request_id: str, reason: str) -> Request | None:
        """End a request (``stop``, ``length`` or ``abort``) and free its pages, unless the
        connector still reads them (freed when it reports the transfer done). Idempotent;
        returns the request, or None for an unknown id."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return req
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[request_id]
        if request_id in self._sent:
            self._finished_ids.append(request_id)
            del self._sent[request_id]
        self._trimmed.discard(request_id)
        self._compactions.pop(request_id, None)
        delay = self.connector is not None and self.connector.request_finished(
            req, self.kv_manager.get_block_ids(request_id))
        if delay:
            self._delayed_free.add(request_id)
        else:
            self.kv_manager.free(request_id)
        return req

    def _finish_transfers(self, result: ModelRunnerOutput) -> None:
        """Free pages whose delayed release the connector has finished with."""
        for rid in result.finished_sending & self._delayed_free:
            self._delayed_free.discard(rid)
            self.kv_manager.free(rid)

    def step_failed(self, sched: SchedulerOutput) -> None:
        """The runner raised on ``sched``: tell it again next step which requests ended
        (it may never have read them), and end the step's requests (their KV writes are
        incomplete)."""
        self._finished_ids = list(sched.finished_req_ids) + self._finished_ids
        if self.connector is not None:
            self.connector.step_failed(sched)
        for rid in sched.req_ids:
            self.finish(rid, "abort")

    def is_id_in_use(self, request_id: str) -> bool:
        """Live, or ended with pages a KV connector still holds."""
        return request_id in self.requests or request_id in self._delayed_free

    @property
    def num_delayed_free(self) -> int:
        """Requests whose pages wait for the connector."""
        return len(self._delayed_free)
