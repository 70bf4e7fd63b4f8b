"""Perplexity through the engine: what a KV-cache setting costs in quality.

The text is tokenized, its first ``num_tokens`` tokens cut into non-overlapping windows
of ``window`` tokens, and every window sent as one request with ``prompt_logprobs=0``
(all at once, so they batch and chunk like real traffic). Each window scores tokens
``1..window-1`` given the tokens before them in that window; perplexity is
``exp(-mean log p)`` over all scored tokens (natural log), the usual strided-window
evaluation (e.g. HF's "Perplexity of fixed-length models" guide) with stride = window.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pagedkv.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class PerplexityResult:
    """``ppl`` = exp(``nll``); ``nll`` mean negative log-likelihood (nats per token)."""
    kv_cache_dtype: str
    ppl: float
    nll: float
    num_scored_tokens: int
    num_windows: int
    window: int

    def to_dict(self) -> dict:
        return asdict(self)


def windows(token_ids: list[int], num_tokens: int, window: int) -> list[list[int]]:
    """Non-overlapping windows over the first ``num_tokens`` ids (a short last one is kept
    if it has at least 2 tokens). Raises ValueError for a window under 2 tokens."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    ids = token_ids[:num_tokens]
    out = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in out if len(w) >= 2]


def perplexity(llm, token_ids: list[int], num_tokens: int, window: int) -> PerplexityResult:
    """Perplexity of ``token_ids`` under ``llm`` (a :class:`pagedkv.LLM`).

    Raises:
        ValueError: no window to score, or a window longer than the engine's max_model_len.
    """
    wins = windows(token_ids, num_tokens, window)
    if not wins:
        raise ValueError("the text has fewer than 2 tokens to score")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in wins], params)
    logps = [lp for o in outs for lp in o.prompt_logprobs[1:]]
    nll = -sum(logps) / len(logps)
    dtype = llm.engine.parts.spec.dtype
    return PerplexityResult(dtype, math.exp(nll), nll, len(logps), len(wins), window)
