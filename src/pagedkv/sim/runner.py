"""The simulator's runner: computes nothing, answers each step as the model runner would
and advances the virtual clock by the step's seconds.

It follows each request's length from the :class:`~pagedkv.core.runner_io.SchedulerOutput`
deltas (the whole token list of a new or resumed request, the new tokens of a cached
one), so it knows which chunks reach their request's last token: those sample one
token (``token_id``; lengths, not values, matter to a schedule). A step's seconds come
from a :class:`StepTimes` source: the cost model, a fixed time, or a recorded run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pagedkv.core.kv_eviction import KVEvictionPolicy
from pagedkv.core.runner_io import ModelRunnerOutput, SampledTokens, SchedulerOutput
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.planner.roofline import StepWork, chunk_work
from pagedkv.sim.clock import VirtualClock
from pagedkv.sim.cost import StepCost, step_kind
from pagedkv.sim.spec import SpecDraws
from pagedkv.sim.tier import SimTierWorker


@dataclass
class _EvictState:
    """What :class:`~pagedkv.core.kv_eviction.KVEvictionPolicy` reads of a request."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    num_computed_tokens: int = 0
    num_evicted_tokens: int = 0


def kept_indices(length: int, budget: int, num_sinks: int, window: int) -> list[int]:
    """A keep list as :func:`~pagedkv.worker.eviction_scores.select_tokens` returns one for
    equal scores: the sinks, the earliest ``budget - sinks - window`` tokens after them, the
    last ``window``; ascending, ``budget`` of ``length`` cache indices."""
    room = budget - num_sinks - window
    return list(range(num_sinks + room)) + list(range(length - window, length))


IDLE_WAKE_AFTER_S = 0.05  # an idle wait this long makes the next step pay the wake-up cost


class StepTimes(Protocol):
    """Seconds of step ``index``: its work, requests and kind (:func:`~pagedkv.sim.cost.step_kind`)."""
    def __call__(self, index: int, work: StepWork, num_requests: int, kind: str | None = None) -> float: ...


def cost_model_times(cost: StepCost) -> StepTimes:
    """Each step's seconds from the cost model (:class:`~pagedkv.sim.cost.StepCost`)."""
    return lambda index, work, num_requests, kind=None: cost.seconds(work, num_requests, kind)


def fixed_times(seconds: float) -> StepTimes:
    """Every step takes ``seconds``."""
    return lambda index, work, num_requests, kind=None: seconds


class RecordedTimes:
    """A recorded run's clock (:class:`~pagedkv.bench.driver.EngineRun` ``step_starts`` and
    ``step_seconds``, seconds from its start), for :class:`SimRunner` ``replay``: the virtual
    clock is *set* to each recorded step start, so arrivals land between the same steps as
    in the recorded run.

    ``idle_after[i]``: nothing was left to run after step ``i`` (the driver then waited for
    the next arrival). Such a step ends at its own end, not at the next start, so its tokens
    are not stamped after the idle wait (which once put a whole arrival gap into the last
    token of every request that ended alone: replayed TPOT 3x the real one at 0.3 req/s).
    :meth:`of` reads it from an ``EngineRun``.
    """

    def __init__(self, step_starts: list[float], step_seconds: list[float],
                 idle_after: list[bool] | None = None) -> None:
        if len(step_starts) != len(step_seconds) or (idle_after is not None and len(idle_after) != len(step_starts)):
            raise ValueError("a recording has one start, one duration and one idle flag per step")
        self.starts, self.seconds = list(step_starts), list(step_seconds)
        self.idle_after = list(idle_after) if idle_after is not None else [False] * len(self.starts)

    @classmethod
    def of(cls, run) -> RecordedTimes:
        """The recording of a driven run (:class:`~pagedkv.bench.driver.EngineRun`), with the
        steps after which its driver waited for an arrival.

        Raises:
            ValueError: a run whose lists are not one entry per step.
        """
        return cls(run.step_starts, run.step_seconds, run.idle_after)

    def start(self, index: int) -> float | None:
        """When step ``index`` started (None past the last one)."""
        return self.starts[index] if index < len(self.starts) else None

    def end(self, index: int) -> float:
        """When step ``index`` handed over to the next: the next start (the last, or one
        followed by an idle wait: its own end).

        Raises:
            IndexError: past the recording (the simulation is not following its schedule).
        """
        if index >= len(self.seconds):
            raise IndexError(f"the recorded run has {len(self.seconds)} steps; the simulation needs more "
                             "(it is not following the same schedule)")
        nxt = self.start(index + 1)
        if nxt is None or self.idle_after[index]:
            return self.starts[index] + self.seconds[index]
        return nxt


class SimRunner:
    """A runner (:class:`~pagedkv.core.engine_core.Runner`) over a virtual clock.

    Args:
        clock: the engine core's clock, advanced by each step.
        times: seconds of each step (:func:`cost_model_times`, :func:`fixed_times`).
        replay: instead of ``times``, a :class:`RecordedTimes` whose instants the clock is
            set to, relative to ``replay_t0``.
        token_id: the token every sampled row produces.
        windows: the layers' attention windows (:func:`~pagedkv.planner.roofline.layer_window_mix`),
            capping the KV each chunk reads; ``()`` for full attention.
        spec_draws: speculative decoding (:class:`~pagedkv.sim.spec.SpecDraws`): a request verifying
            drafts samples its accepted ones plus one, every sampling request proposes k
            drafts for its next step, and a draft model's proposing time is added to the step.
        eviction: SnapKV/H2O (:class:`~pagedkv.core.kv_eviction.KVEvictionPolicy`): at each
            eviction point the runner answers a keep list of the budget's size (the sinks, the
            window and the earliest tokens between: which tokens a scorer keeps changes no
            page count), so the scheduler compacts and frees pages as in the engine; chunks
            then read only the kept cache.
        tier: the KV tiers' worker (:class:`~pagedkv.sim.tier.SimTierWorker`): each step's
            loads and swaps add to it, its saves overlap it, disk writes finish on the clock.
        idle_wake_s: seconds added to the first step after the driver's idle waits add up to
            :data:`IDLE_WAKE_AFTER_S` or more (:attr:`~pagedkv.sim.cost.Efficiency.idle_wake_s`;
            not under replay, whose instants hold it).
    """

    def __init__(self, clock: VirtualClock, times: StepTimes | None = None,
                 replay: RecordedTimes | None = None, replay_t0: float = 0.0,
                 token_id: int = 0, windows: tuple[tuple[int | None, float], ...] = (),
                 spec_draws: SpecDraws | None = None, eviction: KVEvictionPolicy | None = None,
                 tier: SimTierWorker | None = None, idle_wake_s: float = 0.0) -> None:
        if (times is None) == (replay is None):
            raise ValueError("give one of times and replay")
        self.clock, self.times, self.replay, self.replay_t0 = clock, times, replay, replay_t0
        self.token_id, self.windows, self.spec_draws, self.eviction = token_id, windows, spec_draws, eviction
        self.evict: dict[str, _EvictState] = {}  # per request, what the eviction policy reads
        self.tier = tier
        self.idle_wake_s, self.idle_s = idle_wake_s, 0.0  # idle_s: the driver's waits since the last step
        self.lengths: dict[str, int] = {}   # tokens of each request the runner knows of
        self.num_steps = 0
        self.busy_s = 0.0                   # modelled seconds of every step

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.lengths.pop(rid, None)
        for r in out.scheduled_new_reqs:
            self.lengths[r.req_id] = len(r.token_ids)
        cached = out.scheduled_cached_reqs
        for rid, new in zip(cached.req_ids, cached.new_token_ids):
            self.lengths[rid] += len(new)
        chunks = out.chunks()
        keep = self._track_eviction(out, chunks) if self.eviction is not None else {}
        lengths, tid = self.lengths, self.token_id
        sampling = [rid for rid, start, n in chunks if start + n >= lengths[rid]]
        result = ModelRunnerOutput(sampled={rid: SampledTokens([tid] * (1 + self._accepted(out, rid)))
                                            for rid in sampling} if self.spec_draws is not None else
                                   dict.fromkeys(sampling, SampledTokens([tid])))  # (read-only: one serves all)
        draft_s = 0.0
        if self.spec_draws is not None:
            result.num_draft_tokens = {rid: len(d) for rid, d in out.scheduled_spec_decode_tokens.items()}
            result.spec_token_ids = {rid: [self.token_id] * self.spec_draws.k for rid in sampling}
            draft_s = self.spec_draws.draft_seconds([self.lengths[rid] for rid in sampling], len(chunks))
        result.kv_keep = keep
        before_s = saves_s = 0.0
        if self.tier is not None:
            before_s, saves_s = self.tier.price(out.kv_connector_metadata, self.clock())
        if chunks or self.replay is not None or before_s:  # (a replayed run's clock moved at every step)
            if self.evict:
                evicted = {rid: st.num_evicted_tokens for rid, st in self.evict.items()}
                cache = [(s - evicted.get(rid, 0), n) for rid, s, n in chunks]
            else:
                cache = [(s, n) for _, s, n in chunks]
            work = chunk_work(cache, len(sampling), self.windows)
            drafts = out.scheduled_spec_decode_tokens
            kind = step_kind([n for _, _, n in chunks], [len(drafts.get(rid, ())) for rid, _, _ in chunks])
            result.execute_seconds = self._advance(work, len(chunks), draft_s, before_s, saves_s, kind)
        if self.tier is not None:
            result.kv_connector_output = self.tier.finish(self.clock())
        return result

    def _track_eviction(self, out: SchedulerOutput, chunks) -> dict[str, list[int]]:
        """Follow each request's progress and compactions as the model runner does, and
        answer a keep list where a chunk reaches the request's eviction point."""
        ev = self.eviction
        for rid in out.finished_req_ids:
            self.evict.pop(rid, None)
        for r in out.scheduled_new_reqs:  # (a resumed request starts over: nothing evicted)
            self.evict[r.req_id] = _EvictState(r.num_prompt_tokens, r.sampling_params, r.num_computed_tokens)
        c = out.scheduled_cached_reqs
        for rid, computed, kept in zip(c.req_ids, c.num_computed_tokens, c.compacted):
            st = self.evict[rid]
            if kept is not None:
                st.num_evicted_tokens = computed - len(kept)
            st.num_computed_tokens = computed
        keep = {}
        for rid, start, n in chunks:
            st = self.evict[rid]
            if start + n == ev.next_eviction(st):
                keep[rid] = kept_indices(start + n - st.num_evicted_tokens, ev.budget(st), ev.num_sinks, ev.window)
        return keep

    def _accepted(self, out: SchedulerOutput, rid: str) -> int:
        drafts = out.scheduled_spec_decode_tokens.get(rid)
        return self.spec_draws.accepted(len(drafts)) if drafts and self.spec_draws is not None else 0

    def _advance(self, work: StepWork, num_requests: int, extra_s: float = 0.0, before_s: float = 0.0,
                 beside_s: float = 0.0, kind: str | None = None) -> float:
        """Move the clock by the step: ``before_s`` of copies, then the forward (and
        ``extra_s``: a draft model's rounds) or ``beside_s`` of copies overlapping it, whichever
        is longer (a recorded run: its recorded instants)."""
        if self.replay is not None:
            end = self.replay.end(self.num_steps)  # (raises past the recording)
            seconds = self.replay.seconds[self.num_steps]
            self.clock.set(max(self.clock(), self.replay_t0 + end))
        else:
            forward = self.times(self.num_steps, work, num_requests, kind) if work.tokens else 0.0
            if self.idle_s >= IDLE_WAKE_AFTER_S:
                forward += self.idle_wake_s
            seconds = before_s + max(forward + extra_s, beside_s)
            self.clock.advance(seconds)
        self.idle_s = 0.0
        self.num_steps += 1
        self.busy_s += seconds
        return seconds

    def sleep(self, seconds: float) -> None:
        """The driver's idle wait: ``seconds`` on the clock, and under replay on to the
        recorded start of the next step (a real sleep overshoots; the recording saw when)."""
        self.clock.advance(seconds)
        self.idle_s += seconds
        nxt = self.replay.start(self.num_steps) if self.replay is not None else None
        if nxt is not None:
            self.clock.set(max(self.clock(), self.replay_t0 + nxt))
