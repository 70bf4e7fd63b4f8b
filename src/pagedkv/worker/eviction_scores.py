"""Attention scores for KV eviction, on the runner's side (see :mod:`pagedkv.core.kv_eviction`).

During a step's forward every layer hands its queries to :class:`AttentionScorer`, which
reads each observed request's keys back from the pages (dequantized if the pages are
int8/fp8) and lets the observed queries attend to them, causally: SnapKV observes the last
``window`` queries of a prompt and max-pools their attention along the keys (kernel 7, as
SnapKV clusters neighbouring tokens); H2O observes every query it computes. The attention
probabilities, summed over the observed queries, heads and layers, score each cached token
(float64). :func:`select_tokens` keeps the sinks, the window and the best-scored tokens
between them, up to the budget.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedkv.attention.reference import gather_pages

POOL_KERNEL = 7  # SnapKV's pooling kernel over key positions (their default for long contexts)
ROWS_PER_PASS = 256  # observed queries scored at once (bounds the [H, rows, keys] workspace)


class Observed(NamedTuple):
    """One request observed this step: the first of its ``num_rows`` observed rows in the
    batch, which are its last rows, so that they sit at cache indices ``length - num_rows
    ..``; ``length``: its cache length after this step; its block table; ``pool``: SnapKV's
    max-pooling."""
    row: int
    num_rows: int
    length: int
    block_table: torch.Tensor
    pool: bool


class AttentionScorer:
    """``scorer(layer, q, pages)`` per layer; ``scores[req_id]`` ``[length]`` after the forward.

    Args:
        observed: the requests to score, by id.
        scale: the attention scale (``ModelConfig.attention_scale``).
    """

    def __init__(self, observed: dict[str, Observed], scale: float) -> None:
        self.observed, self.scale = observed, scale
        self.scores: dict[str, torch.Tensor] = {rid: torch.zeros(o.length, dtype=torch.float64)
                                                for rid, o in observed.items()}

    def __call__(self, layer: int, q: torch.Tensor, pages) -> None:
        """Add layer ``layer``'s scores; ``q`` ``[T, H, D]`` the step's rotated queries,
        ``pages`` its :class:`~pagedkv.kv_cache.storage.LayerKV` (this step's keys written)."""
        for rid, o in self.observed.items():
            k = gather_pages(pages.k, o.block_table, o.length, pages.k_scale).float()  # [L, Hkv, D]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)                  # GQA: [L, H, D]
            mass = torch.zeros(q.shape[1], o.length, device=q.device)
            for r0 in range(0, o.num_rows, ROWS_PER_PASS):
                r1 = min(o.num_rows, r0 + ROWS_PER_PASS)
                mass += self._mass(q[o.row + r0:o.row + r1].float(), k, o.length - o.num_rows + r0)
            if o.pool:
                mass = F.max_pool1d(mass.unsqueeze(0), POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)[0]
            self.scores[rid] += mass.sum(dim=0).double().cpu()

    def _mass(self, qo: torch.Tensor, k: torch.Tensor, first: int) -> torch.Tensor:
        """Attention probabilities of rows ``qo`` ``[r, H, D]`` at cache indices ``first..``
        over keys ``k`` ``[L, H, D]`` (causal), summed over the rows: ``[H, L]``."""
        logits = torch.einsum("whd,lhd->hwl", qo, k) * self.scale
        rows = torch.arange(first, first + qo.shape[0], device=qo.device).unsqueeze(1)
        logits.masked_fill_(torch.arange(k.shape[0], device=qo.device).unsqueeze(0) > rows, float("-inf"))
        return torch.softmax(logits, dim=-1).sum(dim=1)


def select_tokens(scores: torch.Tensor, budget: int, num_sinks: int, window: int) -> list[int]:
    """Cache indices to keep, ascending: ``0..num_sinks-1``, the last ``window``, and the
    ``budget - num_sinks - window`` best ``scores`` between them (ties: the earlier token).

    Raises:
        ValueError: when the budget is under ``num_sinks + window`` or not under the length.
    """
    length = scores.shape[0]
    room = budget - num_sinks - window
    if room < 0 or budget >= length:
        raise ValueError(f"a budget of {budget} tokens must hold the {num_sinks} sinks and the {window}-token "
                         f"window and be under the {length} cached tokens")
    middle = scores[num_sinks:length - window]
    best = torch.sort(middle, descending=True, stable=True).indices[:room] + num_sinks
    return list(range(num_sinks)) + sorted(best.tolist()) + list(range(length - window, length))
