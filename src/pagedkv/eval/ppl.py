"""Perplexity through the engine: what a KV-cache setting costs in quality.

The text is tokenized, its first ``num_tokens`` tokens cut into non-overlapping windows
of ``window`` tokens, and every window sent as one request with ``prompt_logprobs=0``
(all at once, so they batch and chunk like real traffic). Each window scores tokens
``1..window-1`` given the tokens before them in that window; perplexity is
``exp(-mean log p)`` over all scored tokens (natural log), the usual strided-window
evaluation (e.g. HF's "Perplexity of fixed-length models" guide) with stride = window.

``rolling=True`` scores every token instead, with lm-evaluation-harness's
``loglikelihood_rolling`` windows (``lm_eval.utils.get_rolling_token_windows`` with
``context_len=1`` and ``max_seq_len = window - 1``, made disjoint), so its perplexity can be
compared number for number with an lm-eval run against ``pagedkv serve`` at ``max_length =
window + 1`` (lm-eval's API models keep one token of ``max_length`` for generation:
``TemplateAPI`` sets ``self.max_length = max_length - 1``): the text is prefixed with
``prefix_token_id`` (lm-eval takes the tokenizer's BOS, else EOS); window ``j`` is ``s[j(W-1) :
j(W-1) + W]`` of that sequence ``s``, scoring all but its first token; the last, short one is
extended back to ``W`` tokens and scores only the tokens not yet scored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from pagedkv.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class Window:
    """One request: ``token_ids``, of which positions ``first_scored..`` are scored;
    ``offset``: the text position of ``token_ids[0]`` (-1: a prefix token before the text)."""
    token_ids: list[int]
    first_scored: int = 1
    offset: int = 0


@dataclass(frozen=True)
class PositionBucket:
    """Perplexity of the scored tokens at text positions ``start .. end - 1``."""
    start: int
    end: int
    ppl: float
    num_scored_tokens: int


@dataclass(frozen=True)
class PerplexityResult:
    """``ppl`` = exp(``nll``); ``nll`` mean negative log-likelihood (nats per token);
    ``by_position``: the same by position in the text (with ``bucket`` > 0)."""
    kv_cache_dtype: str
    ppl: float
    nll: float
    num_scored_tokens: int
    num_windows: int
    window: int
    by_position: tuple[PositionBucket, ...] = ()

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


def rolling_windows(token_ids: list[int], num_tokens: int, window: int, prefix_token_id: int) -> list[Window]:
    """lm-eval's ``loglikelihood_rolling`` windows over the first ``num_tokens`` ids (see
    the module docstring): every id is scored exactly once. Raises ValueError for a window
    under 2 tokens."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    s = [prefix_token_id] + token_ids[:num_tokens]
    out, stride = [], window - 1
    for start in range(0, len(s) - 1, stride):
        end = min(start + window, len(s))
        if end - start == window or start == 0:
            out.append(Window(s[start:end], offset=start - 1))
        else:  # the short last window: full length, scoring only its new tokens
            begin = max(0, end - window)
            out.append(Window(s[begin:end], first_scored=start + 1 - begin, offset=begin - 1))
    return out


def position_buckets(wins: list[Window], logps: list[list[float]], bucket: int) -> tuple[PositionBucket, ...]:
    """Perplexity per ``bucket`` positions of the text, so that settings compare on the same
    tokens (with one window over the whole text, also the position the model saw)."""
    sums: dict[int, list[float]] = {}
    last = 0
    for w, lps in zip(wins, logps):
        for i, lp in enumerate(lps, start=w.offset + w.first_scored):
            acc = sums.setdefault(i // bucket, [0.0, 0])
            acc[0] -= lp
            acc[1] += 1
            last = max(last, i)
    return tuple(PositionBucket(b * bucket, min((b + 1) * bucket, last + 1), math.exp(nll / n), n)
                 for b, (nll, n) in sorted(sums.items()))


def window_logprobs(llm, wins: list[Window]) -> list[list[float]]:
    """Per window, the log-probabilities (natural log) of its scored tokens, one request
    per window sent all at once with ``prompt_logprobs=0``."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w.token_ids} for w in wins], params)
    return [o.prompt_logprobs[w.first_scored:] for w, o in zip(wins, outs)]


def perplexity(llm, token_ids: list[int], num_tokens: int, window: int, rolling: bool = False,
               prefix_token_id: int | None = None, bucket: int = 0) -> PerplexityResult:
    """Perplexity of ``token_ids`` under ``llm`` (a :class:`pagedkv.LLM`); ``rolling``:
    lm-eval's windows, prefixed with ``prefix_token_id``; ``bucket`` > 0: also by position
    in the text, per ``bucket`` positions (:func:`position_buckets`).

    Raises:
        ValueError: no window to score, a window longer than the engine's max_model_len,
            or ``rolling`` without a prefix token.
    """
    if rolling:
        if prefix_token_id is None:
            raise ValueError("rolling windows need a prefix token id (the tokenizer's BOS or EOS)")
        wins = rolling_windows(token_ids, num_tokens, window, prefix_token_id) if token_ids else []
    else:
        wins = [Window(w, offset=j * window) for j, w in enumerate(windows(token_ids, num_tokens, window))]
    if not wins:
        raise ValueError("the text has fewer than 2 tokens to score")
    per_window = window_logprobs(llm, wins)
    logps = [lp for lps in per_window for lp in lps]
    nll = -sum(logps) / len(logps)
    dtype = llm.engine.kv_spec.dtype
    buckets = position_buckets(wins, per_window, bucket) if bucket > 0 else ()
    return PerplexityResult(dtype, math.exp(nll), nll, len(logps), len(wins), window, buckets)
