"""The CPU KV tier's worker side (:mod:`pagedkv.connectors.offload.cpu_tier` has the scheduler side and
the design): each step's plan as plain data (:class:`OffloadMeta`), and the copies that
carry it out between the device pages and the tier's tensors (and, with a disk tier,
records), on the model's thread or, for saves, on a worker thread beside the forward.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pagedkv.connectors.base import KVConnectorWorker
from pagedkv.connectors.offload.disk_tier import DiskIO
from pagedkv.kernels.cpu.ops import torch_copy_pages
from pagedkv.kv_cache.storage import KVCacheStorage


@dataclass
class OffloadMeta:
    """One step's transfers: ``swap_outs`` (device page, tier slot) first, ``loads`` and
    ``swap_ins`` (tier slot, device page) before the forward, ``saves`` (device page, tier
    slot) as each layer is written; ``step`` numbers the step. With a
    disk tier: ``disk_loads`` (hash, token ids, device page), ``disk_writes`` (CPU slot,
    hash, parent hash, token ids) and ``disk_removes`` (hashes evicted from disk)."""
    step: int
    loads: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    swap_outs: list[tuple[int, int]] = field(default_factory=list)
    swap_ins: list[tuple[int, int]] = field(default_factory=list)
    disk_loads: list[tuple[bytes, tuple, int]] = field(default_factory=list)
    disk_writes: list[tuple[int, bytes, bytes, tuple]] = field(default_factory=list)
    disk_removes: list[bytes] = field(default_factory=list)


class CPUOffloadWorker(KVConnectorWorker):
    """Worker side: copies pages between the device storage and the tier's tensors, and
    (with a disk tier) between records and pages."""

    def __init__(self, tier: KVCacheStorage, disk: DiskIO | None = None, copy_pages=None) -> None:
        self.tier, self.disk, self.copy_pages = tier, disk, copy_pages or torch_copy_pages
        self.metadata: OffloadMeta | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-kv-save")
        self._futures: list[Future] = []
        self._counts = [0, 0, 0.0, 0, 0, 0, 0.0, 0.0]
        self._done_step = 0
        self._load_errors: set[int] = set()
        self._cache: dict[int, tuple[KVCacheStorage, list[torch.Tensor]]] = {}

    def start_load_kv(self, storage) -> None:
        for f in self._futures:  # copies left by a step that raised
            f.result()
        self._futures, self._load_errors, meta = [], set(), self.metadata
        if meta is None:
            return
        t = time.perf_counter()
        swap_s = self._copy(storage, self.tier, meta.swap_outs)  # before anything writes the pages
        swap_s += self._copy(self.tier, storage, meta.swap_ins)
        self._counts[6] += swap_s
        self._counts[5] += len(meta.swap_outs) + len(meta.swap_ins)
        self._counts[7] += self._copy(self.tier, storage, meta.loads)
        if self.disk is not None:
            read = self.disk.bytes_read
            self._load_errors = self.disk.load(meta.disk_loads, storage, self.tier)
            self._counts[3] += len(meta.disk_loads) - len(self._load_errors)
            self._counts[4] += self.disk.bytes_read - read
            self.disk.write(meta.disk_writes, meta.disk_removes, self.tier)  # overlaps the forward
        self._counts[0] += len(meta.loads)
        self._counts[2] += time.perf_counter() - t - swap_s

    def _copy(self, src: KVCacheStorage, dst: KVCacheStorage, pairs: list[tuple[int, int]]) -> float:
        """Copy whole pages ``(src page, dst page)`` of every layer; returns the seconds taken."""
        if not pairs:
            return 0.0
        t = time.perf_counter()
        self.copy_pages(self._page_tensors(dst), torch.tensor([d for _, d in pairs], dtype=torch.int64),
                        self._page_tensors(src), torch.tensor([s for s, _ in pairs], dtype=torch.int64), parallel=True)
        return time.perf_counter() - t

    def _page_tensors(self, storage: KVCacheStorage) -> list[torch.Tensor]:
        """Every page-indexed tensor of ``storage``, all layers (built once per storage)."""
        cached = self._cache.get(id(storage))
        if cached is None or cached[0] is not storage:
            cached = self._cache[id(storage)] = (storage, [x for i in range(storage.num_layers)
                                                           for x in storage.page_tensors(i)])
        return cached[1]

    def save_kv_layer(self, layer: int, storage, attn_metadata) -> None:
        meta = self.metadata
        if meta is None or not meta.saves:
            return
        src = torch.tensor([p for p, _ in meta.saves], dtype=torch.int64)
        dst = torch.tensor([s for _, s in meta.saves], dtype=torch.int64)
        self._futures.append(self._pool.submit(self.copy_pages, self.tier.page_tensors(layer), dst,
                                               storage.page_tensors(layer), src))

    def wait_for_save(self) -> None:
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()  # disk writes are not waited for: they end in a later step (or at close)
        meta = self.metadata
        if meta is not None:
            self._counts[1] += len(meta.saves)
            self._done_step = meta.step

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._load_errors)

    def close(self) -> None:
        """Finish every copy and disk write, then release the disk directory (no more disk
        writes; the CPU tier goes on). Idempotent."""
        for f in self._futures:
            f.exception()
        if self.disk is not None:
            self.disk.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down what close needs
            pass

    def get_connector_output(self):
        """``(step, ok, counts, disk)``: counts = (blocks loaded, blocks saved, load seconds,
        disk blocks loaded, disk bytes read, blocks swapped, swap seconds, CPU tier load copy
        seconds); disk = (written, failed, corrupt) hashes."""
        meta = self.metadata
        if meta is None:
            return None
        disk = None
        if self.disk is not None:
            written, failed = self.disk.finished()
            disk, self.disk.corrupt = (written, failed, self.disk.corrupt), []
        # a failed load leaves a page unwritten that this step's later tokens attended to:
        # nothing the step saved is kept (the request recomputes from before that page)
        ok = self._done_step == meta.step and not self._load_errors
        out = (meta.step, ok, tuple(self._counts), disk)
        self._counts = [0, 0, 0.0, 0, 0, 0, 0.0, 0.0]
        return out


def probe_copy_rate(tier: KVCacheStorage, copy_pages, max_pages: int = 16) -> tuple[int, float]:
    """``(bytes, seconds)`` of the fastest of three copies of up to ``max_pages`` scattered
    tier pages onto others with ``copy_pages``: the rate swap preemption is first priced at
    (then every timed copy counts). ``(0, 0.0)`` for a tier of one page."""
    n = min(max_pages, tier.num_blocks // 2)
    if n < 1:
        return 0, 0.0
    src, dst = torch.arange(0, 2 * n, 2), torch.arange(1, 2 * n, 2)  # every other page: scattered
    layers = range(tier.num_layers)
    tensors = [x for i in layers for x in tier.page_tensors(i)]
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        copy_pages(tensors, dst, tensors, src, parallel=True)
        best = min(best, time.perf_counter() - t)
    return n * tier.page_size_bytes, best
