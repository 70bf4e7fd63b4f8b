"""Speculative decoding in the simulator: drafts accepted at a given rate, a draft model's cost.

A cost model has no tokens, so it cannot verify drafts; it draws how many of a step's k
drafts the target accepts. Under the usual model of speculative sampling (Leviathan et al.,
2023, "Fast Inference from Transformers via Speculative Decoding", sec. 3.5), each draft
position is accepted with probability ``alpha`` independently until the first rejection,
so a step that verifies k drafts accepts ``min(G, k)`` of them with G geometric:
``P(accepted >= i) = alpha ** i``. The simulator takes the rate the engine reports
(``stats().spec_decode["acceptance_rate"]``: accepted drafts / drafted, a ``pagedkv bench``
run's figure) and finds the ``alpha`` whose expected ``accepted / k`` equals it.

With a draft model each step that samples also runs the draft k times, one position per
request at a time (its own roofline cost at that batch); n-gram drafts cost nothing here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pagedkv.planner.roofline import chunk_work
from pagedkv.sim.cost import StepCost


def mean_acceptance(alpha: float, k: int) -> float:
    """Expected accepted drafts / k when each of k positions passes with ``alpha`` until
    the first rejection: ``sum_{i=1..k} alpha^i / k``."""
    return sum(alpha ** i for i in range(1, k + 1)) / k


def alpha_for(rate: float, k: int) -> float:
    """The per-position ``alpha`` whose :func:`mean_acceptance` over ``k`` drafts is ``rate``.

    Raises:
        ValueError: ``rate`` outside [0, 1].
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a draft acceptance rate is in [0, 1] (accepted / drafted), got {rate}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # mean_acceptance rises with alpha: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_acceptance(mid, k) < rate else (lo, mid)
    return (lo + hi) / 2


@dataclass
class SpecDraws:
    """Accepted-draft draws for ``k``-token speculation at acceptance ``rate`` (seeded), and
    the draft model's step cost (None for n-gram drafts)."""
    k: int
    rate: float
    seed: int = 0
    draft_cost: StepCost | None = None

    def __post_init__(self) -> None:
        self.alpha = alpha_for(self.rate, self.k)
        self._rng = random.Random(self.seed)

    def accepted(self, num_drafts: int) -> int:
        """How many of ``num_drafts`` leading drafts the target accepts this step."""
        n = 0
        while n < num_drafts and self._rng.random() < self.alpha:
            n += 1
        return n

    def draft_seconds(self, contexts: list[int], num_requests: int) -> float:
        """The draft model proposing k tokens after a step for requests at ``contexts``
        tokens: k decode rounds of the draft over them (0 for n-gram drafts)."""
        if self.draft_cost is None or not contexts:
            return 0.0
        seconds = 0.0
        for i in range(self.k):
            work = chunk_work([(c + i, 1) for c in contexts], len(contexts))
            seconds += self.draft_cost.seconds(work, num_requests)
        return seconds
