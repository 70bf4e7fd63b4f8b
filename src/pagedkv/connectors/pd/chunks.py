"""How a pull's pages travel: the chunk plan, the producer's sender, the consumer's receiver.

The consumer plans (:func:`plan_chunks`) and sends the plan with its pull; the producer
answers a status on the pull's tag, then the chunks on the pull's *data tag*. Each chunk is
its messages and then its XXH3-64 (:class:`~pagedkv.connectors.pd.pages.Digest`). A run of
consecutive destination pages travels as one message per page tensor, sent from the cache
(when the source pages are consecutive too) and received straight into it; other pages
travel *staged*, a chunk as one message through a staging buffer at each end.

The consumer posts its receives once the status says ``ok`` (gloo cannot cancel a posted
receive, so none is posted for data that will not come). A pull that fails part-way drops
the link: its group is aborted, so nothing lands in those pages later.
"""

from __future__ import annotations

import time

from pagedkv.connectors.pd.kv_link import KVLink, LinkError
from pagedkv.connectors.pd.pages import Digest, PageLayout, staging

MAX_CHUNK_BYTES = 32 << 20  # a chunk's bytes at most (32 MiB): its staging buffer, when it needs one
MIN_PIECE_BYTES = 64 << 10  # a run goes as per-tensor pieces only if each is at least this (64 KiB):
# gloo moves large messages near loopback speed and small ones below it, but staging costs two
# copies: 60 messages of 192 KiB took 5.0 ms through gloo here, one staged 12 MB pull ~15 ms
STAGING_BUFFERS = 2  # the consumer works on one staged chunk while the next is on the wire
SENDER_SLOTS = 4  # the producer's staging ring: messages gathered while earlier ones are sent


def data_tag(seq: int) -> int:
    """A pull's data tag: the consumer numbers its pulls with even tags, the data takes the
    odd one after, so a status that came too late for its pull is never matched to a data
    receive (gloo matches a tag's messages to its receives in order)."""
    return seq + 1


def plan_chunks(dst: list[int], layout: PageLayout) -> tuple[list[int], list[list]]:
    """How to move pages into ``dst``: the order (indices into ``dst``) and the chunks, each
    ``[num_pages, staged]``. Destination ids are sorted (a pool hands freed pages out in
    descending runs; sorted, both ends' runs are ascending when both allocated alike) and
    cut into consecutive runs: a run long enough that each page tensor's piece holds
    ``MIN_PIECE_BYTES`` is one chunk, straight into the cache (no buffer, so no size limit:
    fewer, larger messages); the other pages go staged, in chunks of at most
    ``MAX_CHUNK_BYTES`` (or one page)."""
    order = sorted(range(len(dst)), key=dst.__getitem__)
    least = -(-MIN_PIECE_BYTES * len(layout.tensors) // layout.page_bytes)
    runs, start = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or dst[order[i]] != dst[order[i - 1]] + 1:
            runs.append(order[start:i])
            start = i
    most = max_chunk_pages(layout)
    staged = [k for r in runs if len(r) < least for k in r]
    groups = [(r, False) for r in runs if len(r) >= least]
    groups += [(staged[i:i + most], True) for i in range(0, len(staged), most)]
    return [k for g, _ in groups for k in g], [[len(g), st] for g, st in groups]


def max_chunk_pages(layout: PageLayout) -> int:
    return max(1, MAX_CHUNK_BYTES // layout.page_bytes)


def valid_plan(order, chunks, count: int, layout: PageLayout) -> bool:
    """A plan the producer can serve: ``order`` a permutation of ``range(count)``, chunks of
    at least one page that add up to ``count``, staged ones of at most
    :func:`max_chunk_pages` (its staging buffer's size)."""
    most = max_chunk_pages(layout)
    return (isinstance(order, list) and sorted(order) == list(range(count)) and isinstance(chunks, list)
            and all(isinstance(c, list) and len(c) == 2 and isinstance(c[0], int) and isinstance(c[1], bool)
                    and 0 < c[0] <= (most if c[1] else count) for c in chunks)
            and sum(c[0] for c in chunks) == count)


class ChunkSender:
    """The producer's end. Messages that cannot come straight from the cache (a staged
    chunk; a run whose pages are not consecutive here; fault injection) are gathered into a
    ring of staging buffers, each reused once its last send is done."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self.ring: list[list] = [[None, []] for _ in range(SENDER_SLOTS)]  # [buffer, its sends]
        self.turn = 0

    def send(self, link: KVLink, seq: int, block_ids: list[int], chunks: list, fault: str | None = None) -> None:
        """Send ``block_ids`` (in the plan's order) as ``chunks``; each message is hashed
        just before it is posted, so hashing overlaps the earlier messages' transfer.
        Fault injection: ``corrupt`` flips a byte after hashing, in a staged copy (never
        the cache); ``stall`` sends the first message, then waits past the consumer's
        timeout.

        Raises:
            LinkError: the link failed or the consumer stopped taking the data.
        """
        start, tag, sent, self.turn = 0, data_tag(seq), [], 0  # (small pulls reuse the same warm buffers)
        corrupt = fault == "corrupt"
        try:
            for n, staged in chunks:
                ids, start = block_ids[start:start + n], start + n
                digest, last = Digest(), 0 if staged else len(self.layout.tensors) - 1
                msgs = self._messages(link, ids, staged, corrupt)
                for j, (m, slot) in enumerate(msgs):
                    digest.update(m)
                    if corrupt and j == last:
                        m.view(-1)[-1] ^= 0xFF
                    works = link.isend_raw(tag, m)
                    if fault == "stall" and start == n and j == 0:
                        time.sleep(link.timeout.total_seconds() + 1.0)
                    if slot is None:
                        sent += works  # (kept until waited: a send whose work was dropped never arrived)
                    else:
                        slot[1] = works
                sent += link.isend_raw(tag, digest.tensor())
            link.wait([w for slot in self.ring for w in slot[1]] + sent)
            for slot in self.ring:
                slot[1] = []  # (a gloo work is waited once: a second wait waits for another send)
        except LinkError:
            self.ring = [[None, []] for _ in self.ring]  # a send given up on may still read them
            raise

    def _messages(self, link: KVLink, ids: list[int], staged: bool, corrupt: bool):
        """A chunk's messages, each with the ring slot it occupies (None: the cache)."""
        if staged:
            slot = self._slot(link, len(ids) * self.layout.page_bytes)
            self.layout.gather(ids, self.layout.pieces(ids, slot[0]))
            yield slot[0][:len(ids) * self.layout.page_bytes], slot
            return
        if self.layout.consecutive(ids) and not corrupt:
            yield from ((p, None) for p in self.layout.pieces(ids))
            return
        for j in range(len(self.layout.tensors)):
            slot = self._slot(link, len(ids) * self.layout.piece_bytes(j))
            yield self.layout.gather_one(j, ids, slot[0]), slot

    def _slot(self, link: KVLink, nbytes: int) -> list:
        slot, self.turn = self.ring[self.turn], (self.turn + 1) % len(self.ring)
        link.wait(slot[1])
        slot[0], slot[1] = staging(slot[0], nbytes), []
        return slot


class ChunkReceiver:
    """The consumer's end: :meth:`post` once the status is ``ok``, then :meth:`take`.
    Reuses its staging buffers across pulls."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout, self.bufs = layout, [None] * STAGING_BUFFERS
        self.link = self.tag = None
        self.chunks, self.posted, self.staged_ahead, self._staged_seen = [], [], 0, 0

    def post(self, link: KVLink, seq: int, chunks: list, dst: list[int]) -> None:
        """Post the receives of every straight chunk and of the first staged ones."""
        self.link, self.tag = link, data_tag(seq)
        starts = [sum(c[0] for c in chunks[:i]) for i in range(len(chunks))]
        self.chunks = [(dst[a:a + n], staged) for a, (n, staged) in zip(starts, chunks)]
        self.posted, self.staged_ahead, self._staged_seen = [], 0, 0
        self._post_more()

    def _post_more(self) -> None:
        while len(self.posted) < len(self.chunks):
            ids, staged = self.chunks[len(self.posted)]
            if staged and self.staged_ahead == len(self.bufs):
                return
            if staged:
                b = self._staged_seen % len(self.bufs)
                self.bufs[b] = staging(self.bufs[b], len(ids) * self.layout.page_bytes)
                pieces = self.layout.pieces(ids, self.bufs[b])
                msgs = [self.bufs[b][:len(ids) * self.layout.page_bytes]]
                self.staged_ahead, self._staged_seen = self.staged_ahead + 1, self._staged_seen + 1
            else:
                pieces = msgs = self.layout.pieces(ids)
            crc = Digest.empty()
            self.posted.append((pieces, msgs, crc, self.link.irecv_raw(self.tag, *msgs, crc)))

    def take(self, deadline: float | None = None) -> bool:
        """Wait for every chunk (all by ``deadline``, ``time.monotonic()``), hashing each
        piece as it lands; store checked staged chunks. True if any chunk failed its
        checksum (all are still read). A link failure or a timeout part-way drops the link
        (:meth:`drop`) and raises LinkError."""
        bad = False
        try:
            for i, (ids, staged) in enumerate(self.chunks):
                pieces, msgs, crc, works = self.posted[i]
                digest = Digest()
                for m, w in zip(msgs, works):
                    self.link.wait([w], deadline)
                    digest.update(m)
                self.link.wait(works[-1:], deadline)
                if not digest.matches(crc):
                    bad = True
                elif staged and not bad:
                    self.layout.scatter(ids, pieces)
                if staged:
                    self.staged_ahead -= 1
                    self._post_more()
        except LinkError as e:
            self.drop(f"a KV pull failed part-way ({e})")
            raise
        return bad

    def drop(self, reason: str) -> None:
        """Data may still come for receives posted into the cache: drop the link at once."""
        self.bufs = [None] * len(self.bufs)
        self.link.reset(reason)
