"""The CPU KV tier in the simulator: the engine's own tier bookkeeping, copies priced.

``--kv-offload-memory`` runs the engine's :class:`~pagedkv.kv.cpu_offload.CPUOffloadScheduler`
unchanged (its index of blocks by prefix hash, lookups after the device's, pins, the
write-through plan, swap space for ``--preemption-mode swap|auto``); only the worker side is
a cost: each step's copies move whole pages over the host link
(:attr:`~pagedkv.planner.hardware.Device.host_link`, PCIe one way; on the CPU, the measured
copy bandwidth). Loads and swaps run before the step's forward and add to it; saves run
beside the forward, layer by layer (the engine's write-through), and only their excess over
the forward adds. Not simulated: the disk tier.
"""

from __future__ import annotations

from pagedkv.kv.connector import KVConnector, KVConnectorWorker
from pagedkv.kv.cpu_offload import CPUOffloadScheduler
from pagedkv.kv.cpu_offload_worker import OffloadMeta


class SimTierWorker(KVConnectorWorker):
    """Prices each step's :class:`OffloadMeta` at ``link`` bytes/s of ``page_bytes`` pages and
    reports it done, as :class:`~pagedkv.kv.cpu_offload_worker.CPUOffloadWorker` would."""

    def __init__(self, page_bytes: int, link: float) -> None:
        self.page_bytes, self.link = page_bytes, link
        self._output = None

    def price(self, meta: OffloadMeta | None) -> tuple[float, float]:
        """``(seconds before the forward, seconds of saves beside it)`` of this step's copies;
        the step's connector output is then ready (:meth:`get_connector_output`)."""
        if meta is None:
            self._output = None
            return 0.0, 0.0
        page_s = self.page_bytes / self.link
        load_s = len(meta.loads) * page_s
        swapped = len(meta.swap_outs) + len(meta.swap_ins)
        swap_s = swapped * page_s
        counts = (len(meta.loads), len(meta.saves), load_s, 0, 0, swapped, swap_s, load_s)
        self._output = (meta.step, True, counts, None)
        return load_s + swap_s, len(meta.saves) * page_s

    def get_connector_output(self):
        return self._output


def sim_tier(kv, memory_bytes: int, policy: str, page_bytes: int, link: float) -> KVConnector:
    """Both sides of a simulated CPU tier of ``memory_bytes`` behind the KV manager ``kv``.

    Raises:
        ValueError: prefix caching off, several KV cache groups, or less than one page.
    """
    if not kv.enable_prefix_caching:
        raise ValueError("the CPU KV tier (--kv-offload-memory) needs prefix caching: its blocks are keyed by "
                         "their prefix hash")
    if len(kv.groups) != 1:
        raise ValueError("the CPU KV tier supports one KV cache group (full attention) so far")
    capacity = int(memory_bytes) // page_bytes
    if capacity < 1:
        raise ValueError(f"--kv-offload-memory of {int(memory_bytes)} bytes holds no page of {page_bytes} bytes")
    scheduler = CPUOffloadScheduler(kv, capacity, policy, page_bytes, None, (page_bytes, page_bytes / link))
    return KVConnector(scheduler, SimTierWorker(page_bytes, link))
