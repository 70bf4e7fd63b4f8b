"""The CPU KV tier (``--kv-offload-memory``): a second page pool in host memory behind the
device cache, plugged in through the KV connector seam (:mod:`pagedkv.connectors.base`).

Built as it would run over PCIe: the tier is its own set of page tensors with its own
accounting (:class:`~pagedkv.connectors.offload.tier_index.TierIndex`), and every transfer is an explicit
block copy, whole pages (quantized pages with their per-token scales, byte for byte).

- **Save (write-through)**: every block that becomes full in a step (and every device
  prefix hit the tier lacks) is copied to a tier slot, layer by layer as the forward writes
  it: ``save_kv_layer(i)`` hands layer ``i``'s copy to a worker thread, so it overlaps the
  next layers' compute, and the step ends when ``wait_for_save`` has seen every copy done
  (a page is never reused while a copy reads it). Entries become visible to lookups only
  once the runner reports the step that wrote them.
- **Load**: a waiting request's prefix lookup goes device first, then the tier
  (``get_num_new_matched_tokens``: the longest run of ready tier blocks right after the
  device hit, never past a gap, always leaving a token to compute); the tier entries are
  pinned from allocation until the step that copies them into the request's new device
  pages, before its forward.
- **Swap** (``--preemption-mode swap|auto``): a preempted request's pages are kept in the
  tier and copied back when it resumes (:mod:`pagedkv.connectors.offload.swap`); copies out run first
  in the next step, before any page they free can be written again.

With the cache in GPU memory (or on the CPU's float path) the worker side is
:class:`~pagedkv.connectors.offload.device_tier_worker.DeviceOffloadWorker`: the same plan,
carried out on copy and save streams ordered against the forward by events, the tier in
pinned host memory.

Requires prefix caching (the tier is keyed by the chained block hash) and one KV cache
group. Sources: vLLM's KV connector v1 API and its CPU offloading connector (the seam's
names); SGLang HiCache (device -> host write-through).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.connectors.base import KVConnector, KVConnectorScheduler, SwapPlan
from pagedkv.connectors.offload.cpu_tier_worker import CPUOffloadWorker, OffloadMeta, probe_copy_rate
from pagedkv.connectors.offload.device_tier_worker import DeviceOffloadWorker, probe_device_copy_rate
from pagedkv.connectors.offload.disk_records import DiskDirectory
from pagedkv.connectors.offload.disk_tier import RECORD_OVERHEAD, DiskIO, DiskPlan
from pagedkv.connectors.offload.swap import SwapSpace
from pagedkv.connectors.offload.tier_index import TierEntry, TierIndex
from pagedkv.kernels.cpu.ops import torch_copy_pages
from pagedkv.kv.hashing import ROOT_HASH
from pagedkv.kv_cache.storage import KVCacheStorage


@dataclass
class OffloadStats:
    """Counters of the CPU tier (blocks, tokens, bytes, seconds)."""
    capacity_blocks: int
    blocks_used: int = 0
    hit_tokens: int = 0
    blocks_loaded: int = 0
    blocks_saved: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0
    evictions: int = 0
    disk_capacity_blocks: int = 0
    disk_blocks_used: int = 0
    disk_hit_tokens: int = 0
    disk_blocks_loaded: int = 0
    disk_blocks_written: int = 0
    disk_bytes_read: int = 0
    disk_corrupt_records: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    swap_blocks_out: int = 0
    swap_blocks_in: int = 0
    swap_no_room: int = 0
    swap_bytes: int = 0
    swap_seconds: float = 0.0
    copy_bytes_per_s: float = 0.0


class CPUOffloadScheduler(KVConnectorScheduler):
    """Scheduler side: the tier's index, lookups, pins and the plan of each step's copies."""

    def __init__(self, kv, capacity: int, policy: str, page_bytes: int, disk: DiskPlan | None = None,
                 copy_probe: tuple[int, float] = (0, 0.0)) -> None:
        self.kv_manager, self.bs, self.page_bytes = kv, kv.block_size, page_bytes
        self.index = TierIndex(capacity, policy)
        self.swap = SwapSpace(self.index, self.bs, page_bytes)
        self.disk = disk
        self._copied = list(copy_probe)  # (bytes, seconds) of timed page copies: probe, loads, swaps
        self.stats = OffloadStats(capacity)
        if disk is not None:  # what a restart found on disk
            self.stats.disk_capacity_blocks, self.stats.disk_blocks_used = disk.index.capacity, disk.index.num_used
            self.stats.disk_corrupt_records = disk.dir.num_corrupt
        self._step = 0
        self._matched: dict[str, tuple[int, list, list]] = {}  # request -> (first block, CPU, disk entries)
        self._loads: list[tuple[TierEntry, int]] = []
        self._disk_loads: list[tuple[TierEntry, bytes, int, str, int]] = []  # (entry, hash, page, request, block)
        self._disk_loaded: dict[int, list[tuple[bytes, str, int]]] = {}  # step -> its disk loads (hash, request, block)
        self._step_saves: dict[int, list[str]] = {}  # step -> requests it planned saves for
        self._pinned: dict[int, tuple[list, list, list]] = {}  # step -> (CPU, disk) entries, swaps its loads read
        self._swap_ins: list[tuple[int, int]] = []
        self._swapped_in: list = []  # swap records copied back this step
        self._swap_local: dict[str, int] = {}  # swapped request -> its device hit at lookup
        self._planned: dict[str, int] = {}  # request -> blocks its saves were planned up to
        self._ready: list[bytes] = []  # CPU entries that became ready: disk write candidates
        self._requests: dict[str, object] = {}  # allocated, not yet finished: whose saves are planned

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        swapped = self.swap.matched(request.request_id, num_computed_tokens)
        if swapped is not None:
            self._swap_local[request.request_id] = num_computed_tokens
            return swapped
        hashes, first = self.kv_manager.block_hashes(request), num_computed_tokens // self.bs
        max_blocks = (len(request.all_token_ids) - 1) // self.bs  # leave a token to compute
        found = self.index.match(hashes, request.all_token_ids, self.bs, first, max_blocks)
        on_disk = (self.disk.match(hashes, request.all_token_ids, self.bs, first + len(found), max_blocks)
                   if self.disk else [])
        self._matched[request.request_id] = (first, found, on_disk)
        return (len(found) + len(on_disk)) * self.bs

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        rid = request.request_id
        self._requests[rid] = request  # its tokens and hashes, read as its saves are planned
        if rid in self._swap_local:
            copies, rec = self.swap.swap_in(rid, block_ids[0], self._swap_local.pop(rid), num_external_tokens)
            self._swap_ins += copies
            self._swapped_in.append(rec)
            return
        first, found, on_disk = self._matched.pop(request.request_id, (0, [], []))
        n = num_external_tokens // self.bs
        found, on_disk = found[:n], on_disk[:max(0, n - len(found))]
        hashes = self.kv_manager.block_hashes(request)
        self.index.pin(found)
        for k, e in enumerate(found):
            self._loads.append((e, block_ids[0][first + k]))
            self.index.touch(hashes[first + k], hit=True)
        if on_disk:
            self.disk.index.pin(on_disk)
            for k, e in enumerate(on_disk, start=first + len(found)):
                self._disk_loads.append((e, hashes[k], block_ids[0][k], rid, k))
                self.disk.index.touch(hashes[k], hit=True)
        self.stats.hit_tokens += len(found) * self.bs
        self.stats.disk_hit_tokens += len(on_disk) * self.bs

    def request_finished(self, request, block_ids) -> bool:
        self._requests.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)  # matched while waiting, then ended
        self._swap_local.pop(request.request_id, None)
        self._planned.pop(request.request_id, None)
        self.swap.release(request.request_id)
        return False

    def swap_plan(self, request, num_computed_tokens: int) -> SwapPlan | None:
        return self.swap.plan(self.kv_manager.block_hashes(request), request.all_token_ids, num_computed_tokens,
                              self.copy_bytes_per_s)

    def swap_out(self, request, block_ids, plan: SwapPlan) -> bool:
        return self.swap.swap_out(request.request_id, block_ids[0], self.kv_manager.block_hashes(request),
                                  request.all_token_ids, plan.kept_tokens, self._step + 1)

    @property
    def copy_bytes_per_s(self) -> float | None:
        """Measured rate of page copies between the cache and the tier (bytes/s): a probe at
        start, then every timed load and swap."""
        return self._copied[0] / self._copied[1] if self._copied[1] > 0 else None

    def build_connector_meta(self, out) -> OffloadMeta:
        self._step += 1
        meta = OffloadMeta(self._step)
        meta.loads = [(e.slot, page) for e, page in self._loads]
        meta.disk_loads = [(h, e.token_ids, page) for e, h, page, *_ in self._disk_loads]
        if self._disk_loads:
            self._disk_loaded[self._step] = [(h, rid, k) for _, h, _, rid, k in self._disk_loads]
        meta.swap_outs, meta.swap_ins, self.swap.outs = self.swap.outs, self._swap_ins, []
        self._pinned[self._step] = ([e for e, _ in self._loads], [e for e, *_ in self._disk_loads], self._swapped_in)
        self._loads, self._disk_loads, self._swap_ins, self._swapped_in = [], [], [], []
        if self.disk is not None:
            meta.disk_writes = self.disk.plan_writes(self.index, self._ready)
            meta.disk_removes, self.disk.removes, self._ready = self.disk.removes, [], []
        for new in out.scheduled_new_reqs:  # device hits the tier lacks, then what this step fills
            self._planned.pop(new.req_id, None)  # first scheduled, or resumed: from the start
            self._plan_saves(meta, new.req_id, 0, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
        c = out.scheduled_cached_reqs
        for rid, start in zip(c.req_ids, c.num_computed_tokens):
            self._plan_saves(meta, rid, start, start + out.num_scheduled_tokens[rid])
        self._step_saves[self._step] = list(out.num_scheduled_tokens)
        return meta

    def _plan_saves(self, meta: OffloadMeta, rid: str, start: int, end: int) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        hashes, table = self.kv_manager.block_hashes(req), self.kv_manager.get_block_ids(rid)[0]
        # from where the last plan stopped: blocks a speculative step's accepted drafts
        # completed became full (and hashed) only after that step's plan was made; from the
        # head after a step whose saves were dropped (blocks the tier has are only touched)
        first, last = min(start // self.bs, self._planned.get(rid, 0)), min(end // self.bs, len(hashes))
        self._planned[rid] = max(last, self._planned.get(rid, 0))
        for k in range(first, last):
            if hashes[k] in self.index.entries:
                self.index.touch(hashes[k])
                continue
            parent = hashes[k - 1] if k else ROOT_HASH
            slot = self.index.reserve(hashes[k], parent, tuple(req.all_token_ids[k * self.bs:(k + 1) * self.bs]),
                                      self._step)
            if slot is None:
                break  # no room, or a gap: the rest of this chain cannot be stored
            meta.saves.append((table[k], slot))

    def update_connector_output(self, output) -> None:
        """The runner finished a step: ``output`` is :meth:`CPUOffloadWorker.get_connector_output`'s."""
        if output is None:
            return
        step, ok, counts, disk = output
        self._ready += self.index.complete(step, failed=not ok)
        self._saves_done(step, ok)
        self.swap.confirm(step)  # its copies out ran first thing in the step
        self._release_pins(step)
        if self.disk is not None:
            written, failed, corrupt = disk
            self.disk.finish_writes(self.index, written, failed)
            self.disk.drop_corrupt(corrupt)
            self.stats.disk_hit_tokens -= self._discarded_disk_blocks(step, corrupt) * self.bs
        self._count(counts)

    def step_failed(self, scheduler_output) -> None:
        """The runner raised on the step ``scheduler_output`` planned: what it saved or
        swapped out is unknown (dropped), what its loads pinned is released now."""
        meta = scheduler_output.kv_connector_metadata
        if meta is None:
            return
        self.index.complete(meta.step, failed=True)
        self._saves_done(meta.step, False)
        self._disk_loaded.pop(meta.step, None)
        self.swap.confirm(meta.step + 1)  # drops the swaps that step was to copy out
        self._release_pins(meta.step)

    def _saves_done(self, step: int, ok: bool) -> None:
        """A step's saves were kept (``ok``) or dropped: then its requests plan their saves
        from the head again (a rolled-back request recomputes past blocks the tier never got:
        planning from where it stopped would leave a gap that refuses the rest of the chain)."""
        for rid in self._step_saves.pop(step, ()):
            if not ok:
                self._planned.pop(rid, None)

    def _discarded_disk_blocks(self, step: int, corrupt) -> int:
        """Disk blocks ``step`` loaded that its requests did not use: a corrupt record and every
        block after it in the same request (it rolls back to the first bad one and computes them)."""
        loaded, bad = self._disk_loaded.pop(step, []), set(corrupt)
        first_bad: dict[str, int] = {}
        for h, rid, k in loaded:
            if h in bad:
                first_bad[rid] = min(k, first_bad.get(rid, k))
        return sum(1 for _, rid, k in loaded if rid in first_bad and k >= first_bad[rid])

    def _release_pins(self, step: int) -> None:
        """Unpin what the loads of steps up to ``step`` read, and free their swap records."""
        for s in [s for s in self._pinned if s <= step]:
            cpu, on_disk, swapped = self._pinned.pop(s)
            self.index.unpin(cpu)
            for rec in swapped:
                self.swap.free(rec)
            if on_disk:
                self.disk.index.unpin(on_disk)

    def _count(self, counts) -> None:
        st = self.stats
        st.blocks_loaded += counts[0]
        st.blocks_saved += counts[1]
        st.load_seconds += counts[2]
        st.disk_blocks_loaded += counts[3]
        st.disk_bytes_read += counts[4]
        st.swap_bytes += counts[5] * self.page_bytes
        st.swap_seconds += counts[6]
        self._copied[0] += (counts[0] + counts[5]) * self.page_bytes
        self._copied[1] += counts[7] + counts[6]
        st.copy_bytes_per_s = self.copy_bytes_per_s or 0.0
        sw = self.swap.stats
        st.swap_outs, st.swap_ins, st.swap_blocks_out, st.swap_blocks_in, st.swap_no_room = (
            sw.swap_outs, sw.swap_ins, sw.blocks_out, sw.blocks_in, sw.no_room)
        st.bytes_read, st.bytes_written = st.blocks_loaded * self.page_bytes, st.blocks_saved * self.page_bytes
        st.blocks_used, st.evictions = self.index.num_used + self.index.num_held, self.index.num_evictions
        if self.disk is not None:
            st.disk_blocks_used = self.disk.index.num_used
            st.disk_blocks_written = self.disk.num_written
            st.disk_corrupt_records = self.disk.dir.num_corrupt

    def get_stats(self) -> dict:
        """The tier's :class:`OffloadStats` as a dict."""
        return asdict(self.stats)

    def check_invariants(self) -> None:
        self.index.check_invariants()
        if self.disk is not None:
            self.disk.index.check_invariants()


def tier_capacity(kv, memory_bytes: int, page_bytes: int) -> int:
    """Whole pages of ``page_bytes`` a CPU tier of ``memory_bytes`` holds behind the KV
    manager ``kv`` (the engine's tier and the simulator's).

    Raises:
        ValueError: prefix caching off, several KV cache groups, or a size under one page.
    """
    if not kv.enable_prefix_caching:
        raise ValueError("the CPU KV tier (kv_offload_memory, --kv-offload-memory) needs prefix caching "
                         "(--enable-prefix-caching): its blocks are keyed by their prefix hash")
    if len(kv.groups) != 1:
        raise ValueError("the CPU KV tier supports one KV cache group (full attention) so far")
    capacity = int(memory_bytes) // page_bytes
    if capacity < 1:
        raise ValueError(f"kv_offload_memory (--kv-offload-memory) of {int(memory_bytes)} bytes holds no page "
                         f"of {page_bytes} bytes; give at least that much")
    return capacity


def cpu_offload_connector(kv, storage: KVCacheStorage, memory_bytes: int, policy: str, disk_dir: str | None = None,
                          disk_bytes: int = 0, copy_pages=torch_copy_pages, streams=None) -> KVConnector:
    """Both sides of a CPU tier of ``memory_bytes`` (pages laid out as the device ``storage``'s,
    a draft model's layers included; its static scales not counted twice) over the KV manager
    ``kv``, with a disk tier of ``disk_bytes`` in ``disk_dir`` behind it if given;
    ``copy_pages`` moves pages between pools (see :func:`pagedkv.kernels.cpu.ops.copy_pages`).
    With ``streams`` (:mod:`~pagedkv.connectors.offload.streams`; a cache in GPU memory or the
    CPU float path) the worker is :class:`~pagedkv.connectors.offload.device_tier_worker.DeviceOffloadWorker`
    and the tier is in host memory, pinned where the cache is on a GPU.

    Raises:
        ValueError: prefix caching off, several KV cache groups, a size under one page, or
            an unusable disk directory (see :class:`~pagedkv.connectors.offload.disk_records.DiskDirectory`).
    """
    page_bytes = storage.page_size_bytes
    capacity = tier_capacity(kv, memory_bytes, page_bytes)
    plan = io = None
    if disk_dir is not None:
        disk_capacity = int(disk_bytes) // (page_bytes + RECORD_OVERHEAD)
        if disk_capacity < 1:
            raise ValueError(f"kv_offload_disk_size of {int(disk_bytes)} bytes holds no block record")
        directory = DiskDirectory(disk_dir)
        plan, io = DiskPlan(directory, disk_capacity, policy), DiskIO(directory)
    if streams is None:
        tier = storage.like(capacity)
        return KVConnector(CPUOffloadScheduler(kv, capacity, policy, page_bytes, plan,
                                               probe_copy_rate(tier, copy_pages)),
                           CPUOffloadWorker(tier, io, copy_pages))
    device = storage.k[0].device
    worker = DeviceOffloadWorker(storage.like(capacity, pin_memory=device.type == "cuda"), device, streams, io)
    return KVConnector(CPUOffloadScheduler(kv, capacity, policy, page_bytes, plan,
                                           probe_device_copy_rate(worker, storage)), worker)
