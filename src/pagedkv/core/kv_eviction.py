"""Score-based KV eviction that frees pages: the scheduler's side (plain Python).

Two scores pick the tokens a request keeps, ``budget`` in all: the first ``sinks``
(attention sinks, StreamingLLM), the last ``window`` and the best-scored ones between them.

- SnapKV (Li et al. 2024, *SnapKV: LLM Knows What You are Looking for Before Generation*):
  when a prompt longer than the budget ends, the attention of its last ``window`` queries
  (the observation window), max-pooled along the keys, scores the prompt's tokens. Once.
- H2O (Zhang et al. 2023, *H2O: Heavy-Hitter Oracle*): every query's attention
  probabilities accumulate on the keys it reads; the request is scored when a prompt over
  the budget ends and then each time its cache has grown ``block_size`` tokens past the
  budget, so decoding runs in bounded memory too.

Scores are summed over heads and layers (:mod:`pagedkv.worker.eviction_scores`), so one
selection serves every layer and a request keeps one block table. The runner scores and
answers with the tokens to keep; the scheduler then *compacts* the request the next time it
runs: the kept tokens' KV moves, in order, into fresh pages (or the request's own when the
pool has none; failing both, requests are preempted as for a failed allocation, so no
request ever decodes past its eviction point uncompacted), the old pages go back to the
pool (the prompt's published pages stay findable by their hash: their KV is still the full
prompt's), and the request's pages are never published again (their contents no longer
match a token prefix). Later tokens keep their
positions in the text for RoPE and sit at cache index ``p - num_evicted_tokens``.

Outputs do not depend on batching, chunking or preemption: chunks are cut at each
eviction point (a recomputed request replays them), SnapKV's observation window runs in
the chunk that ends the prompt (a prefix hit stops before it, also for a resumed request
whose outputs follow the prompt), and H2O takes no prefix hits (it needs every query's
attention).
"""

from __future__ import annotations

from dataclasses import dataclass

KV_EVICTION_METHODS = ("snapkv", "h2o")


@dataclass(frozen=True)
class KVEvictionPolicy:
    """Engine-wide eviction settings; a request's ``SamplingParams.kv_budget_tokens``
    overrides ``budget_tokens``.

    Attributes:
        method: ``snapkv`` or ``h2o``.
        budget_tokens: tokens a request keeps at an eviction (sinks + window + selected).
        num_sinks: leading tokens always kept.
        window: trailing tokens always kept; SnapKV's observation window.
        block_size: tokens per page; H2O evicts each time a page's worth has accumulated.
    """
    method: str
    budget_tokens: int
    num_sinks: int
    window: int
    block_size: int = 16

    def budget(self, req) -> int:
        own = req.sampling_params.kv_budget_tokens
        return self.budget_tokens if own is None else own

    def next_eviction(self, req) -> int | None:
        """The token index (sequence position) at whose computation ``req`` is next scored
        and compacted: the prompt's end if it is over the budget and nothing was evicted
        yet; under H2O then every time the cache has grown a page past the budget."""
        budget, evicted, prompt = self.budget(req), req.num_evicted_tokens, req.num_prompt_tokens
        if not evicted and prompt > budget:
            return prompt
        if self.method == "h2o":
            return evicted + budget + self.block_size
        return None

    def observes_window(self, req) -> bool:
        """SnapKV scores a prompt from its last queries: they must run in one chunk."""
        return self.method == "snapkv" and self.next_eviction(req) is not None

    def max_hit_tokens(self, req) -> int | None:
        """The longest prefix hit ``req`` may take: up to its prompt's observation window
        when SnapKV will score the prompt (even for a resumed request, whose outputs follow
        the prompt); none under H2O, which accumulates every query's attention."""
        if self.method == "h2o":
            return 0
        return req.num_prompt_tokens - self.window if self.next_eviction(req) == req.num_prompt_tokens else None

    def chunk(self, req, start: int, n: int) -> int:
        """``n`` tokens from ``start`` cut at the next eviction point (a resumed request
        replays them) and, for SnapKV, so that the observation window runs in one chunk
        (0: wait for a step with room for all of it)."""
        point = self.next_eviction(req)
        if point is None or start >= point:
            return n
        n = min(n, point - start)
        if self.observes_window(req) and point - self.window < start + n < point:
            return max(0, point - self.window - start)
        return n

    @staticmethod
    def keep_after(req, keep: list[int], chosen_at: int) -> list[int]:
        """The cache indices to keep: the runner's choice among the first ``chosen_at``,
        then every token cached after it (a step may have gone by)."""
        return list(keep) + list(range(chosen_at, req.num_computed_tokens - req.num_evicted_tokens))


def eviction_policy(config) -> KVEvictionPolicy | None:
    """The policy of an :class:`~pagedkv.config.engine.EngineConfig` (None unless ``kv_eviction``
    is a score-based method; streaming is a sliding-window KV group instead)."""
    if config.kv_eviction not in KV_EVICTION_METHODS:
        return None
    return KVEvictionPolicy(config.kv_eviction, config.kv_budget_tokens, config.num_sink_tokens,
                            config.kv_window_tokens, config.block_size)
