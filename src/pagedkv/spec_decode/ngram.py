"""The n-gram (prompt lookup) proposer and the adaptive switch.

**Proposer** (Saxena 2023, "prompt lookup decoding"; vLLM's ``ngram``): for ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``, find the earliest earlier occurrence
of the context's last ``n`` tokens; propose the (up to ``k``) tokens that followed it. No
match at any ``n``: no proposal. Costs one vectorized scan of the context per ``n``
(numpy), no model call.

**Adaptive switch** (:class:`AdaptiveGate`): a request's drafts cost a verification of
``1 + k`` tokens instead of one; when they keep failing, that is pure loss. Per request,
once ``WINDOW`` draft tokens have been verified, proposing pauses whenever the share of
the last ``WINDOW`` that were accepted falls below ``MIN_ACCEPTANCE``; it resumes after a
pause of ``PAUSE`` steps, doubled on each further failure (up to ``MAX_PAUSE``), reset to
``PAUSE`` by a window above the threshold.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedkv.spec_decode.config import SpeculativeConfig

WINDOW = 16
MIN_ACCEPTANCE = 0.3
PAUSE = 8
MAX_PAUSE = 256


def ngram_propose(token_ids, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest
    suffix of ``token_ids`` of ``lookup_max`` .. ``lookup_min`` tokens; ``[]`` if none."""
    ctx = np.asarray(token_ids, dtype=np.int64)
    size = len(ctx)
    for n in range(min(lookup_max, size - 1), lookup_min - 1, -1):
        windows = sliding_window_view(ctx[:size - 1], n)  # occurrences with a token after them
        hits = np.flatnonzero((windows == ctx[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return ctx[start:start + k].tolist()
    return []


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


class NgramProposer:
    """Proposes drafts for decoding requests of one engine (runner side)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.gate = AdaptiveGate()

    def propose(self, req_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Drafts for the request with context ``token_ids`` (at most ``max_tokens``)."""
        c = self.config
        k = min(c.num_speculative_tokens, max_tokens)
        if k <= 0 or not self.gate.allows(req_id):
            return []
        return ngram_propose(token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
