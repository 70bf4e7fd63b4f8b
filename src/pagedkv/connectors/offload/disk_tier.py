"""The disk tier's two halves inside the CPU tier's connector (:mod:`pagedkv.connectors.offload.cpu_tier`).

Blocks reach the disk from the CPU tier: once a CPU entry is ready, :class:`DiskPlan`
(scheduler side) reserves a disk entry (its parent must be on disk: chains stay
prefix-closed, evicted tail first) and pins the CPU entry until :class:`DiskIO` (worker
side, its own thread) has written the record; a lookup continues on disk where the CPU
tier's run of blocks ends, and :class:`DiskIO` reads those records straight into the
request's device pages before the forward. A record that fails a check on reading is a
load error (the request recomputes from the block before it) and is dropped from the
index. At start the index is rebuilt from the directory's records, parents first.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedkv.connectors.offload.disk_records import DiskDirectory, RecordError, decode, encode
from pagedkv.connectors.offload.tier_index import TierEntry, TierIndex
from pagedkv.kv.hashing import ROOT_HASH, BlockHash

RECORD_OVERHEAD = 8192  # header bytes budgeted per record beside its pages (token ids, layout)


class DiskPlan:
    """Scheduler side: the disk index, its lookups, and which records to write or remove."""

    def __init__(self, directory: DiskDirectory, capacity: int, policy: str) -> None:
        self.dir = directory
        self.index = TierIndex(capacity, policy, track_evictions=True)
        self.writing: dict[BlockHash, TierEntry] = {}  # disk writes in flight -> the CPU entry read
        self.removes: list[BlockHash] = []
        self.num_written = 0
        self.num_records_dropped = self._rebuild()

    def _rebuild(self) -> int:
        """Index the directory's records, parents first; remove orphans and what does not fit."""
        heads = {bytes.fromhex(h["hash"]): h for h in self.dir.headers()}
        placed, dropped = set(), 0
        pending = dict(heads)
        while pending:
            ready = [h for h, head in pending.items()
                     if bytes.fromhex(head["parent"]) in placed or bytes.fromhex(head["parent"]) == ROOT_HASH]
            if not ready:
                break
            for h in ready:
                head = pending.pop(h)
                if self.index.reserve(h, bytes.fromhex(head["parent"]), tuple(head["tokens"]), 0, evict=False) is None:
                    self.dir.remove(h)
                    dropped += 1
                    continue
                self.index.mark_ready(h)
                placed.add(h)
        for h in pending:  # parent missing: a gap no lookup could cross
            self.dir.remove(h)
            dropped += 1
        return dropped

    def match(self, hashes, token_ids, block_size: int, first: int, max_blocks: int) -> list[TierEntry]:
        if self.dir.closed:  # released: another engine may own the directory now
            return []
        return self.index.match(hashes, token_ids, block_size, first, max_blocks)

    def plan_writes(self, cpu: TierIndex, ready_now: list[BlockHash]) -> list[tuple[int, BlockHash, BlockHash, tuple]]:
        """Disk writes for CPU entries that just became ready: ``(cpu slot, hash, parent, tokens)``."""
        out, todo = [], list(ready_now)
        while todo:  # parents first, whatever order the entries became ready in
            left = []
            for h in todo:
                e = cpu.entries.get(h)
                if e is None or not e.ready or h in self.index.entries or not self.dir.writable:
                    continue
                if self.index.reserve(h, e.parent, e.token_ids, 0) is None:
                    left.append(h)  # parent not on disk (yet), or nothing evictable
                    continue
                cpu.pin([e])
                self.writing[h] = e
                out.append((e.slot, h, e.parent, e.token_ids))
            if len(left) == len(todo):
                break
            todo = left
        self.removes += self.index.take_evicted()
        return out

    def finish_writes(self, cpu: TierIndex, written: list[BlockHash], failed: list[BlockHash]) -> None:
        for h in written:
            cpu.unpin([self.writing.pop(h)])
            if h not in self.index.entries:  # its parent's write failed: an orphan file
                self.dir.remove(h)
                continue
            self.index.mark_ready(h)
            self.num_written += 1
        for h in failed:
            if h in self.index.entries:  # a failed parent already took its pending children
                self.index.drop(h)
            cpu.unpin([self.writing.pop(h)])

    def drop_corrupt(self, hashes: list[BlockHash]) -> None:
        """Forget records that failed a check (already removed) and their descendants, whose
        records are removed too: no lookup could reach them past the gap."""
        for h in hashes:
            if h in self.index.entries:
                before = set(self.index.entries)
                self.index.drop(h)
                self.removes += [x for x in before - set(self.index.entries) if x != h]


class DiskIO:
    """Worker side: reads records into device pages, writes records from CPU tier slots."""

    def __init__(self, directory: DiskDirectory) -> None:
        self.dir = directory
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-kv-disk")
        self._futures: list[Future] = []
        self.corrupt: list[BlockHash] = []
        self.bytes_read = 0

    def load(self, loads, storage, tier) -> set[int]:
        """Read each ``(hash, tokens, device page)`` record into ``storage``; returns the pages
        whose record failed a check (their hashes go to :attr:`corrupt`)."""
        like = [t[0] for layer in range(tier.num_layers) for t in tier.page_tensors(layer)]
        bad = set()
        for block_hash, tokens, page in loads:
            data = self.dir.read(block_hash)
            try:
                if data is None:
                    raise RecordError("missing record")
                values = iter(decode(data, block_hash, tokens, like))
            except RecordError as e:
                self.dir.corrupt(self.dir.file(block_hash), str(e))
                self.corrupt.append(block_hash)
                bad.add(page)
                continue
            self.bytes_read += len(data)
            for layer in range(tier.num_layers):
                for dst in storage.page_tensors(layer):
                    dst[page].view(torch.uint8).copy_(next(values).view(torch.uint8))
        return bad

    def write(self, writes, removes, tier) -> None:
        """Queue record writes (from CPU tier slots, pinned until reported) and removals."""
        for h in removes:
            self._futures.append(self._pool.submit(self.dir.remove, h))
        for slot, h, parent, tokens in writes:
            tensors = [t[slot].clone() for layer in range(tier.num_layers) for t in tier.page_tensors(layer)]
            self._futures.append(self._pool.submit(self._write_one, h, parent, tokens, tensors))

    def _write_one(self, h, parent, tokens, tensors):
        try:
            return h, self.dir.write(h, encode(h, parent, tokens, tensors))
        except Exception:  # noqa: BLE001 - a write that fails in any way is a failed write
            return h, False

    def finished(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """``(written, failed)`` hashes of the writes that ended since the last call."""
        done, self._futures = [f for f in self._futures if f.done()], [f for f in self._futures if not f.done()]
        written, failed = [], []
        for f in done:
            r = None if f.exception() is not None else f.result()
            if isinstance(r, tuple):
                (written if r[1] else failed).append(r[0])
        return written, failed

    def drain(self) -> None:
        """Wait for every queued write and removal (none raises: see _write_one, remove)."""
        for f in self._futures:
            f.exception()

    def close(self) -> None:
        """Finish the queued writes and release the directory (another engine may open it);
        no write is planned after this (``DiskDirectory.writable`` goes False)."""
        self.drain()
        self.dir.writable = False
        self.dir.close()

