"""What the model runner asks of a speculative proposer, and the adaptive switch.

The runner calls a proposer at fixed points of a step (:class:`Proposer`): as it applies
the scheduler's plain data (requests that start, end, or lose pages), after verification
(what was accepted), and once the step's tokens are sampled (the next step's drafts).

**Adaptive switch** (:class:`AdaptiveGate`): a request's drafts cost a verification of
``1 + k`` tokens instead of one; when they keep failing, that is pure loss. Per request,
once ``WINDOW`` draft tokens have been verified, proposing pauses whenever the share of
the last ``WINDOW`` that were accepted falls below ``MIN_ACCEPTANCE``; it resumes after a
pause of ``PAUSE`` steps, doubled on each further failure (up to ``MAX_PAUSE``), reset to
``PAUSE`` by a window above the threshold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from pagedkv.config.speculative import SpeculativeConfig
from pagedkv.core.sampling_params import SamplingParams

WINDOW = 16
MIN_ACCEPTANCE = 0.3
PAUSE = 8
MAX_PAUSE = 256


class AdaptiveGate:
    """Per request: whether to propose this step, from its recent acceptance."""

    def __init__(self) -> None:
        self.recent: dict[str, deque[int]] = {}   # 1 per accepted draft token, 0 per rejected
        self.paused: dict[str, int] = {}          # steps left without proposals
        self.pause: dict[str, int] = {}           # the next pause's length

    def allows(self, req_id: str) -> bool:
        left = self.paused.get(req_id, 0)
        if left > 0:
            self.paused[req_id] = left - 1
            return False
        return True

    def record(self, req_id: str, drafted: int, accepted: int) -> None:
        """``drafted`` draft tokens of ``req_id`` were verified, ``accepted`` of them kept."""
        if drafted <= 0:
            return
        window = self.recent.setdefault(req_id, deque(maxlen=WINDOW))
        window.extend([1] * accepted + [0] * (drafted - accepted))
        if len(window) < WINDOW:
            return
        if sum(window) / len(window) < MIN_ACCEPTANCE:
            pause = self.pause.get(req_id, PAUSE)
            self.paused[req_id] = pause
            self.pause[req_id] = min(2 * pause, MAX_PAUSE)
            window.clear()  # judged afresh after the pause
        else:
            self.pause[req_id] = PAUSE

    def forget(self, req_id: str) -> None:
        for d in (self.recent, self.paused, self.pause):
            d.pop(req_id, None)


class RequestView:
    """What a proposer may read of the runner's requests, by id: their token ids so far,
    sampling params, prompt length, computed tokens, block table (the first KV group's:
    a draft model's pages are the target's) and seeded generator. Read-only; it never
    exposes the runner itself.

    Args:
        states: the runner's request states (``CachedRequestState`` by id).
        generators: seeded requests' generators by id.
        default_generator: the engine's generator, for requests without a seed.
    """

    def __init__(self, states: dict, generators: dict, default_generator) -> None:
        self._states, self._generators, self._default = states, generators, default_generator

    def token_ids(self, req_id: str) -> list[int]:
        return self._states[req_id].token_ids

    def sampling_params(self, req_id: str) -> SamplingParams:
        return self._states[req_id].sampling_params

    def num_prompt_tokens(self, req_id: str) -> int:
        return self._states[req_id].num_prompt_tokens

    def num_computed_tokens(self, req_id: str) -> int:
        return self._states[req_id].num_computed_tokens

    def block_table(self, req_id: str) -> list[int]:
        return self._states[req_id].block_ids[0]

    def generator(self, req_id: str):
        return self._generators.get(req_id, self._default)


class Proposer(ABC):
    """The runner-side interface of a proposer; the defaults suit one that keeps no KV
    (subclasses: :class:`~pagedkv.worker.spec_decode.ngram.NgramProposer`,
    :class:`~pagedkv.worker.spec_decode.draft_model.DraftModelProposer`).

    Args:
        config: the engine's speculative settings.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.gate = AdaptiveGate()

    def start(self, req_id: str, num_computed_tokens: int) -> None:
        """A request (new or resumed) whose first ``num_computed_tokens`` positions hold KV."""

    def cut(self, req_id: str, num_slots: int) -> None:
        """The request's block table now covers only its first ``num_slots`` positions."""

    def forget(self, req_id: str) -> None:
        """The request ended or was preempted."""
        self.gate.forget(req_id)

    def record(self, req_id: str, drafted: int, accepted: int) -> None:
        """``accepted`` of the request's ``drafted`` drafts were verified and kept."""
        self.gate.record(req_id, drafted, accepted)

    def draft_probs(self, req_id: str):
        """The distribution each of the request's last drafts was sampled from
        (``[k, V]``), or None for one-hot proposals."""
        return None

    @abstractmethod
    def propose_step(self, requests: RequestView, out, samplers: list[str], sampled: dict, skip: set[str],
                     hooks) -> dict[str, list[int]]:
        """The next step's drafts of each request in ``samplers`` (those that got tokens,
        ``sampled[req_id]``), reading ``requests``; ``out``: the step's SchedulerOutput;
        ``skip``: requests whose step read a page that failed to load; ``hooks``: the KV
        connector's worker side (a draft model's KV is saved with the target's), or None."""
