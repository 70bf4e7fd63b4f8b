"""The decode instance's end of the layer-by-layer KV push (``kv_send_type`` ``PUT_ASYNC``;
the protocol and the prefill instance's end: :mod:`~pagedkv.connectors.pd.push`).

The link's thread hands each pushed message to :meth:`PushBuffer.receive`, which checks it
and keeps it (at most ``kv_buffer_size`` bytes); a decode leg's pull first asks
:meth:`PushBuffer.take` for its transfer and, when every layer's blocks came,
:func:`apply_pushed` copies them into its pages.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

from pagedkv.connectors.pd.pages import Digest
from pagedkv.connectors.pd.push import FORGET_AFTER, BufferPool, LayerPages


class PushEntry:
    """What the decode instance holds of one transfer's pushes."""

    def __init__(self, expires: float) -> None:
        self.parts: list[tuple[int, int, torch.Tensor]] = []  # (layer, first block, bytes), in arrival order
        self.nbytes, self.done, self.dropped = 0, None, False
        self.expires = expires  # the consumer's lease from the first push, then the producer's from its done


class PushBuffer:
    """The decode instance's end: pushed pages by transfer id, at most ``capacity`` bytes of
    them held. Their buffers are pooled for reuse (at most ``capacity`` more bytes kept) and
    sized in powers of two, so the memory behind pushes can reach about 3x ``capacity``.

    A transfer whose pushes would overflow it, fail their checksum or outlive ``lease_s``
    is dropped (its decode leg pulls instead); :meth:`take` hands a finished one over once.
    """

    def __init__(self, capacity: int, lease_s: float) -> None:
        self.capacity, self.lease_s = capacity, lease_s
        self.entries: dict[str, PushEntry] = {}
        self.taken: OrderedDict[str, None] = OrderedDict()  # taken or released: what still comes is dropped
        self.pool = BufferPool(capacity)  # what the link receives pushes into
        self.nbytes = 0
        self.cond = threading.Condition()
        self.counts = dict.fromkeys(("pushes_received", "pushes_late", "pushes_dropped", "push_hits",
                                     "push_misses"), 0)

    def receive(self, meta: dict, data: torch.Tensor | None) -> None:
        """A push or done message from the link's thread."""
        tid = str(meta.get("transfer_id"))
        with self.cond:
            self._expire()
            if tid in self.taken:
                return self._late(data)
            entry = self.entries.get(tid)
            if entry is None:
                entry = self.entries[tid] = PushEntry(time.monotonic() + self.lease_s)
            if entry.dropped:
                return self._late(data)
            if meta.get("given_up") or entry.done is not None:  # (after its done: another prompt under this id)
                self.pool.give(data)
                return self._drop(tid, entry)
            if meta.get("op") == "pushed":
                entry.done = meta
                lease = meta.get("lease_s")
                entry.expires = time.monotonic() + (lease if isinstance(lease, (int, float)) else self.lease_s)
                self.cond.notify_all()
                return
            digest = Digest()
            digest.update(data)
            if int(digest.tensor()[0]) != meta.get("digest") or self.nbytes + data.numel() > self.capacity:
                self.pool.give(data)
                self._drop(tid, entry)
                return
            entry.parts.append((int(meta["layer"]), int(meta["first_block"]), data))
            entry.nbytes += data.numel()
            self.nbytes += data.numel()
            self.counts["pushes_received"] += 1

    def take(self, tid: str, deadline: float, link_up, first_by: float = 0.0) -> PushEntry | None:
        """The finished pushes of ``tid``, removed from the buffer; None when there are none,
        they were dropped, or they did not finish by ``deadline`` (``time.monotonic()``).
        Waits while some have come and the rest are still coming over a live link
        (``link_up()``); while none has come, only until ``first_by`` (a pushing producer's
        first push left during the prefill's first layer, but may trail a short prefill's
        answer: the consumer gives each step
        :data:`~pagedkv.connectors.pd.push.FIRST_PUSH_GRACE_S` for all its legs); a
        transfer that was never pushed (never prefilled there, or scheduled while the link
        was down) is then pulled."""
        grace = min(deadline, first_by)
        with self.cond:
            self._expire()
            if tid in self.taken:
                return None
            while time.monotonic() < deadline and link_up():
                entry = self.entries.get(tid)
                if entry is None and time.monotonic() >= grace or entry is not None and (entry.done or entry.dropped):
                    break
                self.cond.wait(min(0.05, max(1e-3, deadline - time.monotonic())))
            entry = self.entries.get(tid)
            self._forget(tid, entry)
            if entry is not None and entry.done is not None and not entry.dropped:
                return entry  # (the caller recycles it once copied)
            self.recycle(entry)
            return None

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Where the link receives a push of ``nbytes``."""
        return self.pool.take(nbytes)

    def recycle(self, entry: PushEntry | None) -> None:
        """Give a taken entry's buffers back (after its pages were copied out)."""
        if entry is not None:
            for *_, data in entry.parts:
                self.pool.give(data)
            entry.parts = []

    def _late(self, data: torch.Tensor | None) -> None:
        """A message for a transfer already taken, released or dropped: thrown away, counted
        (a layer's data) as ``pushes_late``."""
        if data is not None:
            self.counts["pushes_late"] += 1
        self.pool.give(data)

    def _drop(self, tid: str, entry: PushEntry) -> None:
        self.counts["pushes_dropped"] += 1
        self.nbytes -= entry.nbytes
        self.recycle(entry)
        entry.nbytes, entry.dropped = 0, True
        self.cond.notify_all()

    def _forget(self, tid: str, entry: PushEntry | None) -> None:
        if entry is not None:
            self.nbytes -= entry.nbytes
            del self.entries[tid]
        self.taken[tid] = None
        while len(self.taken) > FORGET_AFTER:
            self.taken.popitem(last=False)

    def expire(self) -> None:
        """Forget transfers past their lease (called each engine step and heartbeat)."""
        with self.cond:
            self._expire()

    def _expire(self) -> None:
        """Transfers past the producer's lease (this end's, until their done says): no decode
        leg came for them in time."""
        now = time.monotonic()
        for tid, entry in [(t, e) for t, e in self.entries.items() if e.expires < now]:
            self.nbytes -= entry.nbytes
            self.recycle(entry)
            del self.entries[tid]

    def release(self, tid: str) -> None:
        """The decode leg is done with ``tid`` (or never takes it): forget what came."""
        with self.cond:
            entry = self.entries.get(tid)
            self._forget(tid, entry)
            self.recycle(entry)

    def clear(self) -> None:
        with self.cond:
            self.entries.clear()
            self.taken.clear()
            self.pool = BufferPool(self.capacity)
            self.nbytes = 0
            self.cond.notify_all()


def apply_pushed(entry: PushEntry, pages: LayerPages, pull: dict) -> bool:
    """Copy what ``entry`` holds of ``pull``'s blocks into its destination pages; False
    (copying nothing) when it is not the pull's prompt or misses a layer's block."""
    done, first, count = entry.done, pull["first_block"], pull["num_blocks"]
    if done.get("tokens_hash") != pull["prompt_hash"] or done.get("num_tokens") != pull["num_prompt_tokens"]:
        return False
    plan: list[list[tuple]] = [[] for _ in pages.layers]
    for layer, fb, data in entry.parts:  # later pushes of a block (a chunk's last, part-filled one) win
        if not 0 <= layer < len(pages.layers):
            return False
        n = data.numel() // pages.page_bytes[layer]
        lo, hi = max(fb, first), min(fb + n, first + count)
        if lo < hi:
            plan[layer].append((data, slice(lo - fb, hi - fb), pull["dst"][lo - first:hi - first], lo, hi))
    for layer_plan in plan:
        covered = set()
        for *_, lo, hi in layer_plan:
            covered.update(range(lo, hi))
        if len(covered) != count:
            return False
    for layer, layer_plan in enumerate(plan):
        for data, rows, dst, _, _ in layer_plan:
            pages.scatter(layer, data, rows, dst)
    return True
