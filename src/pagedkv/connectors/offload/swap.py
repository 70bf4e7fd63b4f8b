"""Swap preemption on the CPU tier (``--preemption-mode swap|auto``): a preempted request's
KV kept in tier slots and copied back when it resumes.

A request preempted with ``C`` computed tokens holds ``ceil(C / block_size)`` pages. Its
leading blocks that the tier already holds as ready prefix entries are only *pinned* (no
copy); the rest (blocks past the tier's run, the partial last block) are copied into
slots *held* outside the tier's index (:meth:`TierIndex.acquire`), before the next
forward can reuse the freed pages. On resume, the request's lookup finds its ``C`` tokens
(less any device prefix hit) and the pages are copied back into its new device pages; the
pins and held slots go back once the step that copied them has run.

A swap is used only once the step that copied it out has been reported: a swap whose step
raised is dropped (its pages are released; the request recomputes). Aborting a swapped
request releases at once. Plain Python; the copies are the worker's
(:class:`~pagedkv.connectors.offload.cpu_tier_worker.CPUOffloadWorker`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.connectors.base import SwapPlan
from pagedkv.connectors.offload.tier_index import TierEntry, TierIndex


@dataclass
class SwapRecord:
    """One swapped-out request: the step that copies it out, its pinned tier entries (blocks
    ``0 .. len(entries) - 1``), its held slots (the blocks after), the tokens kept."""
    step: int
    entries: list[TierEntry]
    slots: list[int]
    num_tokens: int
    confirmed: bool = False

    def slot(self, block: int) -> int:
        n = len(self.entries)
        return self.entries[block].slot if block < n else self.slots[block - n]


@dataclass
class SwapStats:
    """Swap counters: requests and blocks each way, preemptions that found no room."""
    swap_outs: int = 0
    swap_ins: int = 0
    blocks_out: int = 0
    blocks_in: int = 0
    no_room: int = 0
    dropped: int = 0


@dataclass
class SwapSpace:
    """The swapped-out requests of one CPU tier ``index`` (``page_bytes`` per block)."""
    index: TierIndex
    block_size: int
    page_bytes: int
    records: dict[str, SwapRecord] = field(default_factory=dict)
    stats: SwapStats = field(default_factory=SwapStats)
    outs: list[tuple[int, int]] = field(default_factory=list)  # (device page, slot) for the next step

    def plan(self, hashes, token_ids, num_computed: int, copy_rate: float | None) -> SwapPlan | None:
        """What swapping ``num_computed`` tokens would copy, or None when the tier has no
        room; ``copy_rate`` (bytes/s, measured) prices the copy both ways."""
        resident = self._resident(hashes, token_ids, num_computed)
        n = self._num_blocks(num_computed) - len(resident)
        if not self.index.can_acquire(n, keep=resident):  # what swap_out would pin cannot make the room
            self.stats.no_room += 1
            return None
        nbytes = n * self.page_bytes
        return SwapPlan(n, nbytes, 2 * nbytes / copy_rate if copy_rate else 0.0,
                        num_computed, len(resident) * self.block_size)

    def swap_out(self, rid: str, table: list[int], hashes, token_ids, num_computed: int, step: int) -> bool:
        """Keep ``rid``'s first ``num_computed`` tokens, held in device pages ``table``; the
        copies go out with step ``step``. False, keeping nothing, when there is no room."""
        resident = self._resident(hashes, token_ids, num_computed)
        self.index.pin(resident)
        slots = self.index.acquire(self._num_blocks(num_computed) - len(resident))
        if slots is None:
            self.index.unpin(resident)
            self.stats.no_room += 1
            return False
        self.outs += zip(table[len(resident):len(resident) + len(slots)], slots)
        self.records[rid] = SwapRecord(step, resident, slots, num_computed)
        self.stats.swap_outs += 1
        self.stats.blocks_out += len(slots)
        return True

    def matched(self, rid: str, local_tokens: int) -> int | None:
        """Tokens a swapped ``rid`` brings back beyond a device hit of ``local_tokens``; None
        if it has no usable swap (never swapped, or its copy-out step failed)."""
        rec = self.records.get(rid)
        if rec is not None and not rec.confirmed:
            self.release(rid)  # its step never reported: the copies may not have happened
            self.stats.dropped += 1
            rec = None
        return None if rec is None else max(0, rec.num_tokens - local_tokens)

    def swap_in(self, rid: str, table: list[int], local_tokens: int, external_tokens: int) -> tuple[list, SwapRecord]:
        """``(slot, device page)`` copies that bring ``external_tokens`` back after a device hit
        of ``local_tokens``, and the record (to release once the copying step has run)."""
        rec = self.records.pop(rid)
        first = local_tokens // self.block_size
        last = self._num_blocks(local_tokens + external_tokens) if external_tokens else first
        copies = [(rec.slot(k), table[k]) for k in range(first, last)]
        if copies:
            self.stats.swap_ins += 1
            self.stats.blocks_in += len(copies)
        return copies, rec

    def confirm(self, step: int) -> None:
        """The step numbered ``step`` ran to its end: swaps it copied out are usable; ones of
        earlier steps never confirmed are dropped."""
        for rid, rec in list(self.records.items()):
            if not rec.confirmed and rec.step == step:
                rec.confirmed = True
            elif not rec.confirmed and rec.step < step:
                self.release(rid)
                self.stats.dropped += 1

    def release(self, rid: str) -> None:
        """Drop ``rid``'s swap (abort, failure); unknown ids are ignored."""
        rec = self.records.pop(rid, None)
        if rec is not None:
            self.free(rec)

    def free(self, rec: SwapRecord) -> None:
        self.index.unpin(rec.entries)
        self.index.release(rec.slots)

    def _resident(self, hashes, token_ids, num_computed: int) -> list[TierEntry]:
        """The tier's ready prefix entries for the request's leading full blocks."""
        full = min(num_computed // self.block_size, len(hashes))
        return self.index.match(hashes, token_ids, self.block_size, 0, full)

    def _num_blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)
