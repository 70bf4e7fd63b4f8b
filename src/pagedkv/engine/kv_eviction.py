"""Score-based KV eviction that frees pages: the scheduler's side (plain Python).

SnapKV (Li et al. 2024, *SnapKV: LLM Knows What You are Looking for Before Generation*):
at the end of a long prompt, the attention of its last ``window`` queries (the
observation window) says which earlier tokens matter; a request keeps ``budget`` prompt
tokens, namely the first ``sinks`` (attention sinks, StreamingLLM), the last ``window``
and the highest-scoring ones between them, and the rest leave the cache. The runner
scores (:mod:`pagedkv.engine.snapkv`); the scheduler then *compacts* the request: the kept
tokens' KV moves, in order, into fresh pages, the old pages go back to the pool (the
prompt's published pages stay findable by their hash: their KV is still the full
prompt's), and the request's pages are never published again (their contents no longer
match a token prefix). Later tokens keep their positions in the text for RoPE and sit at
cache index ``p - num_evicted_tokens``.

One selection serves every layer and KV head (the scores are summed over them), so a
request keeps one block table. Outputs are deterministic whatever the batching or
chunking: the scheduler makes the prompt's last chunk start at or before the observation
window and end at the prompt's end (a prefix hit leaves the window to compute).
"""

from __future__ import annotations

from dataclasses import dataclass

KV_EVICTION_METHODS = ("snapkv",)


@dataclass(frozen=True)
class KVEvictionPolicy:
    """Engine-wide eviction settings; a request's ``SamplingParams.kv_budget_tokens``
    overrides ``budget_tokens``.

    Attributes:
        method: ``snapkv``.
        budget_tokens: prompt tokens a request keeps (sinks + window + selected).
        num_sinks: leading tokens always kept.
        window: trailing prompt tokens always kept; also the observation window.
    """
    method: str
    budget_tokens: int
    num_sinks: int
    window: int

    def budget(self, req) -> int:
        own = getattr(req.sampling_params, "kv_budget_tokens", None)
        return self.budget_tokens if own is None else own

    def applies(self, req) -> bool:
        """Whether ``req``'s prompt is still to be scored and compacted in this life."""
        return not req.num_evicted_tokens and req.num_prompt_tokens > self.budget(req)

    def num_uncached(self, req) -> int:
        """Prompt tokens a prefix hit must leave to compute: the observation window."""
        return self.window if self.applies(req) else 1

    def chunk(self, req, start: int, n: int) -> int:
        """``n`` tokens from ``start`` cut so that the observation window is computed in one
        chunk that ends the prompt (0: wait for a step with room for all of it)."""
        end, prompt = start + n, req.num_prompt_tokens
        if not self.applies(req) or start >= prompt:
            return n
        if end > prompt:  # a resumed request: its outputs come after the compaction
            return prompt - start
        if prompt - self.window < end < prompt:
            return max(0, prompt - self.window - start)
        return n

    def keep_after(self, req, keep: list[int]) -> list[int]:
        """The cache indices to keep: the runner's choice among the prompt, then every token
        computed after it (a step may have gone by)."""
        return list(keep) + list(range(req.num_prompt_tokens, req.num_computed_tokens))


def eviction_policy(config) -> KVEvictionPolicy | None:
    """The policy of an :class:`~pagedkv.config.EngineConfig` (None unless ``kv_eviction``
    is a score-based method; streaming is a sliding-window KV group instead)."""
    if config.kv_eviction not in KV_EVICTION_METHODS:
        return None
    return KVEvictionPolicy(config.kv_eviction, config.kv_budget_tokens, config.num_sink_tokens,
                            config.kv_window_tokens)
