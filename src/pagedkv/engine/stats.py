"""EngineStats: a snapshot of the engine's KV usage, prefix-cache and request counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    """Counts are blocks, tokens or requests as named; ``kv_bytes_per_token`` is bytes (the
    target's and, with a draft model, the draft's: what one token takes in the pool)."""

    block_size: int
    num_blocks: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    peak_blocks_used: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_rejected: int
    num_generated_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_offload: dict | None = None  # the CPU tier's counters (connectors.offload.cpu_tier.OffloadStats), if on
    preemptions_by_mode: dict | None = None  # {"recompute": n, "swap": m}
    spec_decode: dict | None = None  # speculative decoding counters (spec_decode.stats), if on
    blocks_freed_by_window: int = 0  # pages a sliding window gave back before their request ended
    tokens_evicted: int = 0            # tokens score-based eviction (snapkv) dropped from caches
    blocks_freed_by_eviction: int = 0  # pages its compactions gave back on net
    kv_transfer: dict | None = None  # the P/D connector's counters (``transfer_stats()``), if any

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks in use (cached-evictable blocks count as free)."""
        return self.blocks_used / self.num_blocks

    def to_dict(self) -> dict:
        return asdict(self) | {"kv_usage": self.kv_usage}


def collect_stats(engine) -> EngineStats:
    """The stats of an :class:`~pagedkv.engine.engine.LLMEngine`: its KV manager's usage, the
    scheduler's counters (:class:`~pagedkv.core.scheduler_stats.SchedulerStats`), the
    connector's on both sides."""
    kv_manager = engine.kv_manager
    usage, sched = kv_manager.usage(), engine.scheduler.stats()
    connector = engine.connector
    return EngineStats(
        block_size=kv_manager.block_size, num_blocks=usage.total, blocks_used=usage.used,
        blocks_cached=usage.cached, blocks_free=usage.free, peak_blocks_used=engine.peak_blocks_used,
        kv_bytes_per_token=sum(s.bytes_per_token for s in engine.kv_cache.specs),  # every layer, a draft's too
        kv_cache_bytes=engine.kv_cache.nbytes,
        num_running=sched.num_running, num_waiting=sched.num_waiting, num_preemptions=sched.num_preemptions,
        num_rejected=engine.num_rejected, num_generated_tokens=engine.num_generated_tokens,
        prefix_cache_queries=kv_manager.prefix_queries, prefix_cache_hits=kv_manager.prefix_hits,
        kv_offload=sched.connector, preemptions_by_mode=sched.preemptions_by_mode,
        spec_decode=sched.spec_decode, blocks_freed_by_window=kv_manager.blocks_given_back,
        tokens_evicted=sched.tokens_evicted, blocks_freed_by_eviction=sched.blocks_freed_by_eviction,
        kv_transfer=connector.worker.transfer_stats() if connector is not None else None)
