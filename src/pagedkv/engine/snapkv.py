"""SnapKV's scores and choice, on the runner's side (see :mod:`pagedkv.engine.kv_eviction`).

During the forward of a step whose chunk ends a long prompt, every layer hands its
queries to :class:`SnapKVScorer`: the last ``window`` queries of the prompt (the
observation window) attend, causally, to all the prompt's keys read back from the pages
(dequantized if the pages are int8/fp8); their attention probabilities, summed over the
window's queries, max-pooled along the keys (kernel 7, as SnapKV clusters neighbouring
tokens) and summed over heads and layers, score each prompt token. :func:`select_tokens`
keeps the sinks, the window and the best-scored tokens between them, up to the budget.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedkv.attention.paged import gather_pages

POOL_KERNEL = 7  # SnapKV's pooling kernel over key positions (their default for long contexts)


class Observed(NamedTuple):
    """One request observed this step: its window's first row in the batch, its prompt
    length (= its cache length: nothing evicted yet) and its block table."""
    row: int
    length: int
    block_table: torch.Tensor


class SnapKVScorer:
    """``scorer(layer, q, pages)`` per layer; ``scores[req_id]`` ``[length]`` after the forward.

    Args:
        observed: the requests to score, by id.
        window: observation window (queries per request).
        scale: the attention scale (``head_dim ** -0.5``).
    """

    def __init__(self, observed: dict[str, Observed], window: int, scale: float) -> None:
        self.observed, self.window, self.scale = observed, window, scale
        self.scores: dict[str, torch.Tensor] = {rid: torch.zeros(o.length, dtype=torch.float64)
                                                for rid, o in observed.items()}

    def __call__(self, layer: int, q: torch.Tensor, pages) -> None:
        """Add layer ``layer``'s scores; ``q`` ``[T, H, D]`` the step's rotated queries,
        ``pages`` its :class:`~pagedkv.kv.storage.LayerKV` (this step's keys written)."""
        for rid, o in self.observed.items():
            k = gather_pages(pages.k, o.block_table, o.length, pages.k_scale).float()  # [L, Hkv, D]
            qo = q[o.row:o.row + self.window].float()                                 # [w, H, D]
            k = k.repeat_interleave(qo.shape[1] // k.shape[1], dim=1)                 # GQA: [L, H, D]
            logits = torch.einsum("whd,lhd->hwl", qo, k) * self.scale
            rows = torch.arange(o.length - self.window, o.length).unsqueeze(1)
            logits.masked_fill_(torch.arange(o.length).unsqueeze(0) > rows, float("-inf"))
            mass = torch.softmax(logits, dim=-1).sum(dim=1)                           # [H, L]
            pooled = F.max_pool1d(mass.unsqueeze(0), POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)[0]
            self.scores[rid] += pooled.sum(dim=0).double()


def select_tokens(scores: torch.Tensor, budget: int, num_sinks: int, window: int) -> list[int]:
    """Prompt positions to keep, ascending: ``0..num_sinks-1``, the last ``window``, and the
    ``budget - num_sinks - window`` best ``scores`` between them (ties: the earlier token).

    Raises:
        ValueError: when the budget is under ``num_sinks + window`` or not under the prompt.
    """
    length = scores.shape[0]
    room = budget - num_sinks - window
    if room < 0 or budget >= length:
        raise ValueError(f"a budget of {budget} tokens must hold the {num_sinks} sinks and the {window}-token "
                         f"window and be under the prompt's {length} tokens")
    middle = scores[num_sinks:length - window]
    best = torch.sort(middle, descending=True, stable=True).indices[:room] + num_sinks
    return list(range(num_sinks)) + sorted(best.tolist()) + list(range(length - window, length))
