"""The length limits of an engine, decided once from its config, model and KV pool: shared
by the engine and the simulator.

``max_model_len`` starts from the request (or the model's positions), is checked against
streaming eviction's positions, and is capped by what one request can hold in the whole
pool (:func:`cache_max_model_len`), so ``max_tokens=None`` means "fill the cache", never
"be rejected". ``step_tokens`` bounds what one request computes or holds slots for in a step.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from pagedkv.config.engine import EngineConfig
from pagedkv.core.admission import request_peak_blocks
from pagedkv.core.kv_eviction import eviction_policy
from pagedkv.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from pagedkv.model.config import ModelConfig


def resolve_max_model_len(cfg: ModelConfig, requested: int | None, streaming: bool = False) -> int:
    """``max_model_len``: the request, capped by the model's positions (sliding-window
    layers attend to their window at any length), unless ``streaming`` eviction bounds
    what a token sees (``EngineConfig.streaming_positions``); the default is the model's.

    Raises:
        ValueError: if ``requested`` exceeds what the model supports here.
    """
    limit = cfg.max_position_embeddings
    if requested is not None and requested > limit and not streaming:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit} tokens "
                         "(only --kv-eviction streaming runs past it)")
    return requested or limit


def check_streaming(config: EngineConfig, cfg: ModelConfig) -> None:
    """Streaming's cache positions must stay within the model's: sinks + window at most
    ``max_position_embeddings`` (raises ValueError); original positions past them warn."""
    if config.kv_eviction != "streaming":
        return
    limit, cache = cfg.max_position_embeddings, config.num_sink_tokens + config.kv_window_tokens
    if config.streaming_positions == "cache" and cache > limit:
        raise ValueError(f"num_sink_tokens + kv_window_tokens = {cache} exceeds the model's {limit} positions: "
                         "positions within the cache would too")
    if config.streaming_positions == "original" and (config.max_model_len or 0) > limit:
        warnings.warn(f"pagedkv: streaming with original positions past the model's {limit}: the sinks lie at "
                      "distances the model never saw (streaming_positions 'cache' keeps them within)",
                      RuntimeWarning, stacklevel=3)


def cap_to_cache(max_len: int, cache_tokens: int, explicit: bool) -> int:
    """``max_model_len`` capped at what the whole cache holds when it came from the model
    (so ``max_tokens=None`` means "fill the cache", not "be rejected"). A value the user set
    is kept: requests over the cache are then rejected one by one, naming both limits."""
    if max_len <= cache_tokens or explicit:
        return max_len
    return cache_tokens


def cache_max_model_len(config: EngineConfig, kv: KVCacheManager, max_len: int) -> int:
    """``max_len`` capped by what one request can use of ``kv``'s pool: the longest request
    whose peak pages (:meth:`KVCacheManager.peak_blocks`, every group) fit the pool: the
    whole cache under full attention, any length when a window or H2O eviction bounds its
    pages (a long prompt is then refused by itself), and for window and full groups side by
    side what both hold at once (:func:`cap_to_cache` keeps a value the user set)."""
    num_blocks, step, policy = kv.pool.num_blocks, step_tokens(config), eviction_policy(config)

    def fits(total: int) -> bool:  # a one-token prompt: SnapKV scores none, H2O scores as it goes
        return request_peak_blocks(kv, total, 1, step, policy) <= num_blocks

    lo, hi = 0, max_len  # the peak grows with the length: the longest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    if lo == 0:
        raise ValueError(f"a KV cache of {num_blocks} blocks cannot hold a one-token request, which needs "
                         f"{kv.peak_blocks(1, step)} (a block in each of its {len(kv.groups)} KV groups at least): "
                         "give it more memory (--kv-cache-memory or --num-blocks)")
    return cap_to_cache(max_len, lo, config.max_model_len is not None)


def step_tokens(config: EngineConfig) -> int:
    """The most tokens one request computes or holds slots for in a step: a prefill chunk
    (``max_num_batched_tokens``) plus speculative decoding's lookahead slots."""
    sc = config.speculative_config
    return config.max_num_batched_tokens + (sc.num_lookahead_tokens if sc is not None else 0)
