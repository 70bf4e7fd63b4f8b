"""The KV tiers in the simulator: the engine's own tier bookkeeping, copies priced.

``--kv-offload-memory`` runs the engine's :class:`~pagedkv.connectors.offload.cpu_tier.CPUOffloadScheduler`
unchanged (its index of blocks by prefix hash, lookups after the device's, pins, the
write-through plan, swap space for ``--preemption-mode swap|auto``); only the worker side is
a cost: each step's copies move whole pages over the host link
(:attr:`~pagedkv.planner.hardware.Device.host_link`, PCIe one way; on the CPU, the measured
copy bandwidth). Loads and swaps run before the step's forward and add to it; saves run
beside the forward, layer by layer (the engine's write-through), and only their excess over
the forward adds.

``--kv-offload-dir`` / ``--kv-offload-disk-size`` add the engine's disk tier behind it: its
:class:`~pagedkv.connectors.offload.disk_tier.DiskPlan` unchanged (records written from ready CPU
entries, parents first, the CPU entry pinned until its write is reported; lookups continue
on disk where the CPU run ends) over a directory that holds no files (the simulated disk
starts empty: the path is neither read nor written). Disk loads run before the forward at
the NVMe read rate plus the host link (:func:`~pagedkv.planner.hardware.disk_block_load_seconds`,
the planner's figure); writes queue on one writer, as the engine's single disk thread, at
the NVMe write rate, and each is reported done at the first step end after it finishes.
Not priced: the copy of a CPU slot the engine takes before queueing a write, and record
headers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.connectors.base import KVConnector, KVConnectorWorker
from pagedkv.connectors.offload.cpu_tier import CPUOffloadScheduler, tier_capacity
from pagedkv.connectors.offload.cpu_tier_worker import OffloadMeta
from pagedkv.connectors.offload.disk_tier import RECORD_OVERHEAD, DiskPlan


@dataclass(frozen=True)
class TierCosts:
    """What one page's copies cost in the simulated tiers.

    Attributes:
        page_bytes: bytes of one KV page (every layer's K and V, scales included).
        link: device <-> CPU tier copy rate, bytes/s (PCIe one way; a CPU: its page copy rate).
        disk_load_s: seconds to load one page from the disk tier into the device cache.
        disk_write_s: seconds to write one page's record to the disk tier.
    """
    page_bytes: int
    link: float
    disk_load_s: float = 0.0
    disk_write_s: float = 0.0


class SimDiskDirectory:
    """The disk tier's directory as :class:`DiskPlan` sees it, with no files: empty at start,
    every write succeeds, nothing is ever corrupt."""
    closed = False
    writable = True
    num_corrupt = 0

    def headers(self) -> list[dict]:
        return []

    def remove(self, block_hash: bytes) -> None:
        pass


class SimTierWorker(KVConnectorWorker):
    """Prices each step's :class:`OffloadMeta` by :class:`TierCosts` and reports it done, as
    :class:`~pagedkv.connectors.offload.cpu_tier_worker.CPUOffloadWorker` would; disk writes finish on
    the virtual clock, one after another."""

    def __init__(self, costs: TierCosts, disk: bool = False) -> None:
        self.costs, self.disk = costs, disk
        self._meta: OffloadMeta | None = None
        self._counts: tuple = ()
        self._writes: list[tuple[float, bytes]] = []  # (finish time, hash), in finish order
        self._disk_free = 0.0                          # when the disk writer is idle again

    def price(self, meta: OffloadMeta | None, start: float = 0.0) -> tuple[float, float]:
        """``(seconds before the forward, seconds of saves beside it)`` of this step's copies,
        the step starting at ``start`` on the clock; disk writes are queued from the end of
        the copies before the forward. Then :meth:`finish` gives the step's output."""
        self._meta = meta
        if meta is None:
            return 0.0, 0.0
        c = self.costs
        page_s = c.page_bytes / c.link
        load_s = len(meta.loads) * page_s
        swapped = len(meta.swap_outs) + len(meta.swap_ins)
        swap_s = swapped * page_s
        disk_s = len(meta.disk_loads) * c.disk_load_s
        before = load_s + swap_s + disk_s
        t = max(start + before, self._disk_free)
        for _, h, _, _ in meta.disk_writes:
            t += c.disk_write_s
            self._writes.append((t, h))
        self._disk_free = t
        n_disk = len(meta.disk_loads)
        self._counts = (len(meta.loads), len(meta.saves), load_s + disk_s, n_disk, n_disk * c.page_bytes, swapped,
                        swap_s, load_s)  # (load seconds count disk loads too, as the engine's worker times them)
        return before, len(meta.saves) * page_s

    def finish(self, end: float):
        """The step's connector output (as ``CPUOffloadWorker.get_connector_output``), the
        step ending at ``end``: disk writes finished by then are reported written."""
        if self._meta is None:
            return None
        disk = None
        if self.disk:
            done = [h for t, h in self._writes if t <= end]
            self._writes = self._writes[len(done):]
            disk = (done, [], [])
        return self._meta.step, True, self._counts, disk


def sim_tier_worker(config, costs: TierCosts | None) -> SimTierWorker | None:
    """The simulated tiers' worker side for ``config`` (None without ``kv_offload_memory``);
    the runner takes it at construction (:class:`~pagedkv.sim.runner.SimRunner`).

    Raises:
        ValueError: a tier without its copy costs.
    """
    if not config.kv_offload_memory:
        return None
    if costs is None:
        raise ValueError("a simulated KV tier needs its copy costs (SimSetup passes them)")
    return SimTierWorker(costs, config.kv_offload_dir is not None)


def sim_tier(kv, config, worker: SimTierWorker) -> KVConnector:
    """Both sides of the simulated tiers of ``config`` (``kv_offload_memory``, and the disk
    tier when ``kv_offload_dir`` is set) behind the KV manager ``kv``; ``worker``: the
    runner's tier worker (:func:`sim_tier_worker`), whose costs price the copies.

    Raises:
        ValueError: prefix caching off, several KV cache groups, or a tier under one page.
    """
    costs = worker.costs
    page = costs.page_bytes
    capacity = tier_capacity(kv, config.kv_offload_memory, page)
    disk = None
    if config.kv_offload_dir is not None:
        disk_capacity = int(config.kv_offload_disk_size) // (page + RECORD_OVERHEAD)  # as the engine sizes it
        if disk_capacity < 1:
            raise ValueError(f"--kv-offload-disk-size of {int(config.kv_offload_disk_size)} bytes holds no block "
                             "record")
        disk = DiskPlan(SimDiskDirectory(), disk_capacity, config.kv_offload_policy)
    scheduler = CPUOffloadScheduler(kv, capacity, config.kv_offload_policy, page, disk, (page, page / costs.link))
    return KVConnector(scheduler, worker)
