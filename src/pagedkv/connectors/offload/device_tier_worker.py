"""The CPU tier's worker when the KV cache is not the C++ library's CPU pool: the cache in GPU
memory (the tier in pinned host memory, copies over PCIe on their own CUDA streams), or the
CPU float path (bf16/fp16 compute; the same code on :class:`~pagedkv.connectors.offload.streams.InlineStreams`).

Same plan as :class:`~pagedkv.connectors.offload.cpu_tier_worker.CPUOffloadWorker`
(:class:`~pagedkv.connectors.offload.cpu_tier_worker.OffloadMeta`), carried out as batched
copies per layer and tensor (:mod:`~pagedkv.connectors.offload.page_moves`): on a GPU one
Triton launch that reads or writes the pinned tier directly, whatever the slots' order;
on the CPU (or if the kernel cannot address the tier) a gather or scatter on the cache's
side and one transfer per run of consecutive tier slots.

Ordering (see :mod:`~pagedkv.connectors.offload.streams`): swap-outs copy every layer's
pages first on the copy stream, after the event the compute stream recorded at the step's
start (a swap-out's page may be written again once they are done: the compute stream waits
for them); swap-ins, loads and disk loads follow layer by layer, each layer's last copy
recording the event ``wait_for_layer_load`` makes the compute stream wait on (disk records
are read and checked on the host first, into staging pages, pinned beside a GPU, whose
copies run like loads); a layer's saves start on the save stream after the compute
stream's event for that layer's writes. ``wait_for_save`` (after the step's sampling) waits
for the copy and save streams' last events: nothing the step copies outlives it, so no page
or slot is reused while a copy of it is in flight, and the forward itself never waits for
a save.
"""

from __future__ import annotations

import time
import warnings

import torch

from pagedkv.connectors.offload.cpu_tier_worker import CPUOffloadWorker
from pagedkv.connectors.offload.disk_tier import DiskIO
from pagedkv.connectors.offload.page_moves import Pages, choose_move, kernel_move, run_move
from pagedkv.connectors.offload.streams import Access, InlineStreams
from pagedkv.kv_cache.storage import KVCacheStorage


class DeviceOffloadWorker(CPUOffloadWorker):
    """Worker side of the CPU tier for a cache on ``device`` (see the module docstring);
    ``streams``: :class:`~pagedkv.connectors.offload.streams.CudaStreams` on a GPU,
    :class:`~pagedkv.connectors.offload.streams.InlineStreams` on the CPU, or a test's fake."""

    def __init__(self, tier: KVCacheStorage, device: torch.device, streams=None, disk: DiskIO | None = None) -> None:
        super().__init__(tier, disk)
        self.device, self.streams = device, streams or InlineStreams()
        self._load_events: dict[int, object] = {}
        self._ends: list[object] = []      # the step's last events, waited for by wait_for_save
        self._saved = None                 # the save stream's last event this step
        self._timed: list[tuple[int, object, object]] = []  # (count index, start, end) to price
        self._held: list[torch.Tensor] = []  # staging tensors alive until their copies end
        self._staging: KVCacheStorage | None = None  # disk records on their way to the device
        self._move = choose_move(device)
        self._indices: dict[tuple[int, int], tuple[list, Pages]] = {}  # this step's, by (pairs, side)

    # ---- copies ---------------------------------------------------------------------------
    def _to_tier(self, stream, storage: KVCacheStorage, layer: int, pairs: list[tuple[int, int]]) -> None:
        """Copy device pages to tier slots, ``(page, slot)`` pairs, one layer, on ``stream``."""
        pages, slots = [p for p, _ in pairs], [s for _, s in pairs]

        def copy():
            src_pages, dst_slots = self._pages(pairs, 0), self._pages(pairs, 1)
            for src, dst in zip(storage.page_tensors(layer), self.tier.page_tensors(layer)):
                self._held += self._moved(dst, dst_slots, src, src_pages, True)
        self.streams.launch(stream, copy, reads=_acc("device", layer, pages), writes=_acc("tier", layer, slots),
                            nbytes=len(pairs) * self.tier.page_size_bytes // max(1, self.tier.num_layers))

    def _to_device(self, stream, storage: KVCacheStorage, layer: int, pairs: list[tuple[int, int]],
                   source: KVCacheStorage | None = None, pool: str = "tier") -> None:
        """Copy tier slots (or ``source``'s, e.g. the disk staging) to device pages, ``(slot,
        page)`` pairs, one layer, on ``stream``."""
        slots, pages, source = [s for s, _ in pairs], [p for _, p in pairs], source or self.tier

        def copy():
            src_slots, dst_pages = self._pages(pairs, 0), self._pages(pairs, 1)
            for src, dst in zip(source.page_tensors(layer), storage.page_tensors(layer)):
                self._held += self._moved(dst, dst_pages, src, src_slots, False)
        self.streams.launch(stream, copy, reads=_acc(pool, layer, slots), writes=_acc("device", layer, pages),
                            nbytes=len(pairs) * self.tier.page_size_bytes // max(1, self.tier.num_layers))

    def _pages(self, pairs: list[tuple[int, int]], side: int) -> Pages:
        """Side ``side`` of a step's ``pairs`` as :class:`Pages`: uploaded on the first layer's
        copy (on its stream, which alone reads it), kept until the step's copies end."""
        key = (id(pairs), side)
        if key not in self._indices:
            self._indices[key] = (pairs, Pages.of([pair[side] for pair in pairs], self.device))
        return self._indices[key][1]

    def _moved(self, dst, dst_pages, src, src_pages, to_host: bool) -> list[torch.Tensor]:
        """One tensor's pages moved by this worker's way; the kernel, refused (a tier the GPU
        cannot address), gives way to torch's copies for good, with one warning."""
        try:
            return self._move(dst, dst_pages, src, src_pages, to_host)
        except (ValueError, RuntimeError) as e:
            if self._move is not kernel_move:
                raise
            warnings.warn(f"pagedkv: the KV tier's page-copy kernel failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); tier copies run as torch copies",
                          RuntimeWarning, stacklevel=2)
            self._move = run_move
            return run_move(dst, dst_pages, src, src_pages, to_host)

    # ---- the step -------------------------------------------------------------------------
    def start_load_kv(self, storage) -> None:
        self._settle()
        self._load_errors, meta = set(), self.metadata
        if meta is None:
            return
        s, layers = self.streams, range(storage.num_layers)
        s.wait(s.copy, s.record(s.compute))  # after what the previous step wrote
        if meta.swap_outs:
            start = s.record(s.copy)
            for layer in layers:
                self._to_tier(s.copy, storage, layer, meta.swap_outs)
            swapped_out = s.record(s.copy)
            self._timed.append((6, start, swapped_out))
            s.wait(s.compute, swapped_out)  # their pages may be written from here on
        from_disk = self._read_disk(meta) if self.disk is not None else []
        if meta.swap_ins or meta.loads or from_disk:
            for layer in layers:  # layer by layer: layer 0 computes while the rest load
                for index, pairs in ((6, meta.swap_ins), (7, meta.loads)):
                    if pairs:
                        start = s.record(s.copy)
                        self._to_device(s.copy, storage, layer, pairs)
                        self._timed.append((index, start, s.record(s.copy)))
                if from_disk:
                    start = s.record(s.copy)
                    self._to_device(s.copy, storage, layer, from_disk, self._staging, "disk staging")
                    self._timed.append((2, start, s.record(s.copy)))
                self._load_events[layer] = s.record(s.copy)
            self._ends.append(self._load_events[layers[-1]])
        self._counts[5] += len(meta.swap_outs) + len(meta.swap_ins)
        self._counts[0] += len(meta.loads)
        if self.disk is not None:
            self.disk.write(meta.disk_writes, meta.disk_removes, self.tier)  # reads slots saved in earlier steps

    def _read_disk(self, meta) -> list[tuple[int, int]]:
        """Read this step's disk records into the staging pages (host memory, pinned beside a
        GPU; grown as needed, reused once the last step's copies ended); returns the
        ``(staging page, device page)`` pairs whose records passed their checks (the others'
        device pages are this step's load errors)."""
        if not meta.disk_loads:
            return []
        n, t = len(meta.disk_loads), time.perf_counter()
        if self._staging is None or self._staging.num_blocks < n:
            self._staging = self.tier.like(max(n, 2 * (self._staging.num_blocks if self._staging else 0)),
                                           pin_memory=self.device.type == "cuda")
        read = self.disk.bytes_read
        bad = self.disk.load([(h, tokens, j) for j, (h, tokens, _) in enumerate(meta.disk_loads)],
                             self._staging, self.tier)
        self._load_errors = {meta.disk_loads[j][2] for j in bad}
        self._counts[3] += n - len(bad)
        self._counts[4] += self.disk.bytes_read - read
        self._counts[2] += time.perf_counter() - t  # load seconds: the records' reads and checks, then their copies
        return [(j, page) for j, (_, _, page) in enumerate(meta.disk_loads) if j not in bad]

    def wait_for_layer_load(self, layer: int) -> None:
        event = self._load_events.pop(layer, None)
        if event is not None:
            self.streams.wait(self.streams.compute, event)

    def needs_layer_hooks(self) -> bool:
        """After ``start_load_kv``: whether any layer must wait for copies into its pages
        (loads, swap-ins, disk records) or start saves."""
        meta = self.metadata
        return bool(self._load_events) or (meta is not None and bool(meta.saves))

    def save_kv_layer(self, layer: int, storage, attn_metadata) -> None:
        meta = self.metadata
        if meta is None or not meta.saves:
            return
        s = self.streams
        s.wait(s.save, s.record(s.compute))  # after this layer's writes
        self._to_tier(s.save, storage, layer, meta.saves)
        self._saved = s.record(s.save)  # the save stream's last: it covers every save before it

    def wait_for_save(self) -> None:
        self._settle()
        meta = self.metadata
        if meta is not None:
            self._counts[1] += len(meta.saves)
            self._done_step = meta.step

    def _settle(self) -> None:
        """Wait for the step's copies (and price its loads and swaps); drop the staging."""
        ends = self._ends + [end for _, _, end in self._timed] + ([self._saved] if self._saved is not None else [])
        for event in ends:
            self.streams.synchronize(event)
        for index, start, end in self._timed:
            seconds = self.streams.elapsed(start, end)
            self._counts[index] += seconds
            if index == 7:
                self._counts[2] += seconds
        self._ends, self._timed, self._held, self._load_events, self._saved = [], [], [], {}, None
        self._indices = {}

    def close(self) -> None:
        self._settle()
        super().close()


def _acc(pool: str, layer: int, pages: list[int]) -> list[Access]:
    return [(pool, layer, p) for p in pages]


def probe_device_copy_rate(worker: DeviceOffloadWorker, storage: KVCacheStorage,
                           max_pages: int = 16) -> tuple[int, float]:
    """``(bytes, seconds)`` of the fastest of three loads of up to ``max_pages`` tier slots
    into device pages 1.. of ``storage`` (free at start; page 0 is the null page), timed by
    the streams' events: the rate swap preemption is first priced at. ``(0, 0.0)`` when
    either pool is too small."""
    n = min(max_pages, worker.tier.num_blocks, storage.num_blocks - 1)
    if n < 1:
        return 0, 0.0
    s, pairs, best = worker.streams, [(i, 1 + i) for i in range(n)], float("inf")
    for _ in range(3):
        start = s.record(s.copy)
        for layer in range(storage.num_layers):
            worker._to_device(s.copy, storage, layer, pairs)
        end = s.record(s.copy)
        s.synchronize(end)
        best = min(best, s.elapsed(start, end))
        worker._settle()
    return n * worker.tier.page_size_bytes, best
