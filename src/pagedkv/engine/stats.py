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
    kv_offload: dict | None = None  # the CPU tier's counters (kv.cpu_offload.OffloadStats), if on
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
    usage, kv, sched = engine.kv.usage(), engine.kv, engine.scheduler
    return EngineStats(
        block_size=kv.block_size, num_blocks=usage.total, blocks_used=usage.used,
        blocks_cached=usage.cached, blocks_free=usage.free, peak_blocks_used=engine.peak_blocks_used,
        kv_bytes_per_token=sum(s.bytes_per_token for s in engine.parts.storage.specs),  # every layer, a draft's too
        kv_cache_bytes=engine.parts.storage.nbytes,
        num_running=len(sched.running), num_waiting=len(sched.waiting), num_preemptions=sched.num_preemptions,
        num_rejected=engine.num_rejected, num_generated_tokens=engine.num_generated_tokens,
        prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
        kv_offload=_offload_stats(sched.connector), preemptions_by_mode=dict(sched.preemptions_by_mode),
        spec_decode=sched.spec_stats.to_dict() if sched.spec_stats is not None else None,
        blocks_freed_by_window=sum(getattr(g, "blocks_given_back", 0) for g in kv.groups),
        tokens_evicted=sched.num_tokens_evicted, blocks_freed_by_eviction=sched.blocks_freed_by_eviction,
        kv_transfer=_transfer_stats(getattr(engine.runner, "connector", None)))


def _transfer_stats(worker) -> dict | None:
    get = getattr(worker, "transfer_stats", None)
    return get() if get is not None else None


def _offload_stats(connector) -> dict | None:
    stats = getattr(connector, "stats", None)
    return asdict(stats) if stats is not None else None
