"""Layer-by-layer KV push (``kv_send_type`` ``PUT_ASYNC``): the prompt's pages go to the
decode instance while the prefill is still computing.

With pulls (``GET``, the default) the decode instance asks for a prompt's pages once its
prefill has ended, so the transfer adds to the time to first token. With pushes the prefill
instance sends each layer's pages of a prefill chunk as soon as that layer has written them
(:meth:`PushSender.layer_written`, called from the connector's ``save_kv_layer``): the layer's
pages are copied out of the cache at once (a few MB at most, beside a layer's compute on a
whole chunk) and a sender thread hashes and sends the copy while the next layers and chunks
compute. After the request's last chunk a *done* message says how many prompt tokens the
pushes cover and their hash. The decode instance's link thread receives the pushes into a
bounded buffer (``kv_buffer_size`` bytes, as vLLM's P2P connector; that end:
:mod:`~pagedkv.connectors.pd.push_buffer`); when the decode leg arrives its pages are copied
from there instead of pulled. Anything missing (a push dropped for room, a failed checksum, a lost link, pushes
that did not finish in time, a decode leg whose first push has not come within
:data:`FIRST_PUSH_GRACE_S`) falls back to the pull, whose lease is unchanged: the prefill
instance holds the pages under its lease either way, so nothing is lost and the ownership
rules of :mod:`~pagedkv.connectors.pd.producer` still bound every page's life.

A push message (tag :data:`PUSH_TAG`): JSON ``{op: push, transfer_id, layer, first_block,
num_blocks, digest}`` and the bytes of those pages of that layer (per page tensor of the
layer, K, V and any per-token scales, each ``num_blocks`` pages in block order), XXH3-64
checked. ``{op: pushed, transfer_id, num_tokens, tokens_hash, num_blocks}`` ends it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque

import torch

from pagedkv.connectors.pd.kv_link import PUSH_TAG, KVLink, LinkError
from pagedkv.connectors.pd.pages import Digest

log = logging.getLogger("pagedkv.kv_transfer")
MAX_QUEUED_BYTES = 512 << 20  # the producer's copies waiting for the wire (512 MiB): past it, a transfer stops pushing
FORGET_AFTER = 4096           # transfer ids the sender remembers as given up (oldest forgotten)
FIRST_PUSH_GRACE_S = 0.25     # a decode leg waits this long for a pushing producer's first push of its prompt


class BufferPool:
    """Byte buffers kept for reuse, by size class (powers of two from 64 KiB), at most
    ``max_bytes`` pooled. A push's buffers are a prompt's whole KV: fresh memory for each
    would pay the OS's first-touch page faults every time (measured on this VM: a 4,096-token
    prompt's 188 MB took 0.2-0.5 s to copy out of fresh buffers, 14 ms out of reused ones)."""

    MIN_CLASS = 64 << 10

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.pooled = max_bytes, 0
        self.free: dict[int, list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (a view of a pooled or new buffer of its class)."""
        size = max(self.MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())
        with self.lock:
            bufs = self.free.get(size)
            if bufs:
                self.pooled -= size
                return bufs.pop()[:nbytes]
        return torch.empty(size, dtype=torch.uint8)[:nbytes]

    def give(self, t: torch.Tensor | None) -> None:
        """Return a tensor :meth:`take` made (kept if the pool has room)."""
        base = t if t is None or t._base is None else t._base
        if base is None or base.numel() < self.MIN_CLASS or base.numel() & (base.numel() - 1):
            return
        with self.lock:
            if self.pooled + base.numel() <= self.max_bytes:
                self.free.setdefault(base.numel(), []).append(base)
                self.pooled += base.numel()


class LayerPages:
    """One storage's page tensors by layer, as bytes: what a push of a layer moves.

    Raises:
        ValueError: layers share page tensors (their pages could not be pushed one layer
            at a time).
    """

    def __init__(self, storage) -> None:
        self.layers = [[t.view(torch.uint8) if t.element_size() == 1 else t for t in storage.page_tensors(i)]
                       for i in range(storage.num_layers)]
        if len({id(t) for ts in self.layers for t in ts}) != sum(len(ts) for ts in self.layers):
            raise ValueError("kv_send_type PUT_ASYNC needs each layer's own page tensors (these layers share pages)")
        self.page_bytes = [sum(t[0].numel() * t.element_size() for t in ts) for ts in self.layers]

    def gather(self, layer: int, page_ids: list[int], pool: BufferPool) -> torch.Tensor:
        """A uint8 tensor from ``pool``: ``layer``'s bytes of ``page_ids``, tensor by tensor."""
        n, idx = len(page_ids), torch.tensor(page_ids, dtype=torch.int64)
        buf, off = pool.take(n * self.page_bytes[layer]), 0
        for t in self.layers[layer]:
            size = n * t[0].numel() * t.element_size()
            torch.index_select(t, 0, idx, out=buf[off:off + size].view(t.dtype).view(n, *t.shape[1:]))
            off += size
        return buf

    def scatter(self, layer: int, data: torch.Tensor, rows: slice, page_ids: list[int]) -> None:
        """Store pages ``rows`` of a push of ``layer`` (``data``: its bytes, as
        :meth:`gather` made them) into ``page_ids``."""
        n, idx, off = len(data) // self.page_bytes[layer], torch.tensor(page_ids, dtype=torch.int64), 0
        for t in self.layers[layer]:
            size = n * t[0].numel() * t.element_size()
            t.index_copy_(0, idx, data[off:off + size].view(t.dtype).view(n, *t.shape[1:])[rows])
            off += size


class PushSender:
    """The prefill instance's end: copies made in the engine thread, sent by a thread of its own."""

    def __init__(self, link: KVLink, pages: LayerPages, lease_s: float,
                 max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        self.link, self.pages, self.lease_s, self.max_queued_bytes = link, pages, lease_s, max_queued_bytes
        self.queue: deque = deque()
        self.queued_bytes = 0
        self.cond = threading.Condition()
        self.given_up: OrderedDict[str, None] = OrderedDict()  # transfers that stopped pushing
        self.pool = BufferPool(max_queued_bytes)
        self.counts = (dict.fromkeys(("pushes", "push_blocks", "push_bytes", "pushes_given_up"), 0)
                       | {"push_seconds": 0.0})
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="pagedkv-kv-push", daemon=True)
        self.thread.start()

    def layer_written(self, job: dict, layer: int) -> None:
        """``layer`` of ``job``'s pages is written (engine thread): copy them, queue the copy."""
        tid = job["transfer_id"]
        if tid in self.given_up or not self.link.ready.is_set():
            return self._give_up(tid)
        data = self.pages.gather(layer, job["block_ids"], self.pool)
        with self.cond:
            if self.queued_bytes + data.numel() > self.max_queued_bytes:
                self.pool.give(data)
                return self._give_up(tid)
            self.queue.append(({"op": "push", "transfer_id": tid, "layer": layer, "first_block": job["first_block"],
                                "num_blocks": len(job["block_ids"])}, data, job.get("fault")))
            self.queued_bytes += data.numel()
            self.cond.notify()

    def chunk_done(self, job: dict) -> None:
        """Every layer of ``job``'s chunk is queued; after its last chunk, queue the done message."""
        if job.get("final"):
            self._enqueue({"op": "pushed", "transfer_id": job["transfer_id"], "num_tokens": job["num_tokens"],
                           "tokens_hash": job["tokens_hash"], "num_blocks": job["num_blocks"], "lease_s": self.lease_s})

    def give_up(self, tid: str) -> None:
        """Push no more of ``tid`` (its prefill ended unfinished): see :meth:`_give_up`."""
        self._give_up(tid)

    def _give_up(self, tid: str) -> None:
        """Push no more of ``tid``, and tell the consumer (so its pull does not wait for it)."""
        with self.cond:
            if tid in self.given_up:
                return
            self.counts["pushes_given_up"] += 1
            self.given_up[tid] = None
            while len(self.given_up) > FORGET_AFTER:
                self.given_up.popitem(last=False)
            self.queue.append(({"op": "pushed", "transfer_id": tid, "given_up": True}, None, None))
            self.cond.notify()

    def _enqueue(self, meta: dict) -> None:
        with self.cond:
            self.queue.append((meta, None, None))
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                meta, data, fault = self.queue.popleft()
                self.queued_bytes -= 0 if data is None else data.numel()
                skip = meta["transfer_id"] in self.given_up and not meta.get("given_up")
            if not skip:
                self._send(meta, data, fault)
            self.pool.give(data)

    def _send(self, meta: dict, data: torch.Tensor | None, fault: str | None) -> None:
        t0 = time.perf_counter()
        try:
            if data is not None:
                digest = Digest()
                digest.update(data)
                meta["digest"] = int(digest.tensor()[0])
                if fault in ("corrupt", "corrupt_push"):
                    data = data.clone()  # (an inference tensor of the engine thread's: not changed in place)
                    data[-1] ^= 0xFF
            self.link.send(PUSH_TAG, meta, data)
        except Exception as e:  # noqa: BLE001 - the link failed (LinkError) or worse: this transfer stops
            if not isinstance(e, LinkError):
                log.exception("KV push of %s failed", meta["transfer_id"])
            if not meta.get("given_up"):
                self._give_up(meta["transfer_id"])
            return
        if data is not None:
            self.counts["pushes"] += 1
            self.counts["push_bytes"] += data.numel()
            self.counts["push_blocks"] += meta["num_blocks"] if meta["layer"] == 0 else 0  # (pages, once per chunk)
        self.counts["push_seconds"] += time.perf_counter() - t0

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.queue.clear()
            self.cond.notify_all()
        self.thread.join(5.0)
