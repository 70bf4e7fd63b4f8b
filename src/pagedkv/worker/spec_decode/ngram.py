"""The n-gram (prompt lookup) proposer.

**Proposer** (Saxena 2023, "prompt lookup decoding"; vLLM's ``ngram``): for ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``, find the earliest earlier occurrence
of the context's last ``n`` tokens; propose the (up to ``k``) tokens that followed it. No
match at any ``n``: no proposal. Costs one vectorized scan of the context per ``n``
(numpy), no model call. The adaptive switch is :class:`pagedkv.worker.spec_decode.proposer.AdaptiveGate`.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedkv.worker.spec_decode.proposer import AdaptiveGate, Proposer, RequestView

__all__ = ["AdaptiveGate", "NgramProposer", "ngram_propose"]


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


class NgramProposer(Proposer):
    """Proposes drafts for decoding requests of one engine (runner side)."""

    def propose_step(self, requests: RequestView, out, samplers: list[str], sampled: dict, skip: set[str],
                     hooks) -> dict[str, list[int]]:
        result = {}
        for rid in samplers:
            s = sampled[rid]
            if s.error is None and s.token_ids:
                result[rid] = self.propose(rid, requests.token_ids(rid) + s.token_ids,
                                           self.config.num_speculative_tokens)
        return {r: d for r, d in result.items() if d}

    def propose(self, req_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        """Drafts for the request with context ``token_ids`` (at most ``max_tokens``)."""
        c = self.config
        k = min(c.num_speculative_tokens, max_tokens)
        if k <= 0 or not self.gate.allows(req_id):
            return []
        return ngram_propose(token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
