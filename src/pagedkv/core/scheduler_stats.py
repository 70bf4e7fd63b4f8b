"""SchedulerStats: what the scheduler counts, as one plain snapshot (:meth:`Scheduler.stats
<pagedkv.core.scheduler.Scheduler.stats>`) that the engine's stats, the server's metrics and
the benchmarks read instead of the scheduler's attributes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    """Counts are requests, tokens or blocks as named, since the scheduler was made.

    Attributes:
        num_running, num_waiting: requests in each queue now.
        num_preemptions: preemptions so far; ``preemptions_by_mode`` splits them
            ``{"recompute": n, "swap": m}``.
        spec_decode: speculative decoding counters (:mod:`pagedkv.core.spec_decode_stats`),
            None when it is off.
        tokens_evicted: tokens score-based eviction (SnapKV/H2O) dropped from caches;
            ``blocks_freed_by_eviction`` the pages its compactions gave back on net.
        num_kv_load_failures: requests rolled back after a page failed to load.
        connector: the KV connector's counters (``KVConnectorScheduler.get_stats``), or None.
    """
    num_running: int
    num_waiting: int
    num_preemptions: int
    preemptions_by_mode: dict
    spec_decode: dict | None
    tokens_evicted: int
    blocks_freed_by_eviction: int
    num_kv_load_failures: int
    connector: dict | None
