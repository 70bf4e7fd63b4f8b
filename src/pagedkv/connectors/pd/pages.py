"""Pages as bytes: what a KV transfer moves, and the check that it arrived whole.

A page's bytes are, layer by layer, its K, its V and (int8/fp8 per-token-head pages) their
scales: every tensor :meth:`~pagedkv.kv_cache.storage.KVCacheStorage.page_tensors` indexes by page,
so quantized pages travel with their scales. Static (per-head, per-tensor) scales are the
layer's, not the page's: both ends calibrate them on the same text, and the link's
:func:`fingerprint` makes sure they hold the same ones.
"""

from __future__ import annotations

import hashlib

import torch
import xxhash


def _tensors(storage) -> list[torch.Tensor]:
    """Each page-indexed tensor once (layers sharing page tensors give them once)."""
    unique = {id(t): t for layer in range(storage.num_layers) for t in storage.page_tensors(layer)}
    return list(unique.values())


class PageLayout:
    """A chunk of pages as the list of byte pieces a transfer moves: per page tensor, those
    pages' bytes. When the chunk's page ids are consecutive and ascending the pieces are
    views of the page tensors themselves (sent from and received into the cache with no
    copy); otherwise they live in a caller-owned staging buffer, filled by :meth:`gather`
    or stored by :meth:`scatter`."""

    def __init__(self, storage) -> None:
        self.tensors = [t.view(torch.uint8) if t.element_size() == 1 else t for t in _tensors(storage)]
        self.page_bytes = sum(self.piece_bytes(j) for j in range(len(self.tensors)))

    @staticmethod
    def consecutive(page_ids: list[int]) -> bool:
        return all(b == a + 1 for a, b in zip(page_ids, page_ids[1:]))

    def pieces(self, page_ids: list[int], buf: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Per page tensor, a uint8 tensor of these pages' bytes: views of the cache itself
        without ``buf`` (the ids must then be consecutive), else views of ``buf`` (at least
        ``len(page_ids) * page_bytes`` bytes), in order, filling its start.

        Raises:
            ValueError: cache views asked of ids that are not consecutive.
        """
        n, first = len(page_ids), page_ids[0]
        if buf is None:
            if not self.consecutive(page_ids):
                raise ValueError("pages are viewed in the cache only as a consecutive run")
            return [t[first:first + n].view(torch.uint8) for t in self.tensors]
        out, off = [], 0
        for j, t in enumerate(self.tensors):
            size = n * self.piece_bytes(j)
            out.append(buf[off:off + size].view(t.dtype).view(n, *t.shape[1:]).view(torch.uint8))
            off += size
        return out

    def piece_bytes(self, j: int) -> int:
        """One page's bytes in page tensor ``j``."""
        return self.tensors[j][0].numel() * self.tensors[j].element_size()

    def gather_one(self, j: int, page_ids: list[int], buf: torch.Tensor) -> torch.Tensor:
        """Copy the pages' bytes of page tensor ``j`` into the start of ``buf``; that part."""
        t, n = self.tensors[j], len(page_ids)
        out = buf[:n * self.piece_bytes(j)]
        torch.index_select(t, 0, torch.tensor(page_ids, dtype=torch.int64),
                           out=out.view(t.dtype).view(n, *t.shape[1:]))
        return out

    def gather(self, page_ids: list[int], pieces: list[torch.Tensor]) -> None:
        """Copy the pages into staging pieces made by :meth:`pieces`."""
        idx = torch.tensor(page_ids, dtype=torch.int64)
        for t, piece in zip(self.tensors, pieces):
            torch.index_select(t, 0, idx, out=piece.view(t.dtype).view(len(page_ids), *t.shape[1:]))

    def scatter(self, page_ids: list[int], pieces: list[torch.Tensor]) -> None:
        """Store staging pieces (of a storage of the same layout) into the pages."""
        idx = torch.tensor(page_ids, dtype=torch.int64)
        for t, piece in zip(self.tensors, pieces):
            t.index_copy_(0, idx, piece.view(t.dtype).view(len(page_ids), *t.shape[1:]))


def staging(buf: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """``buf`` if it holds ``nbytes``, else a new uint8 buffer of that size."""
    return buf if buf is not None and buf.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)


class Digest:
    """XXH3-64 over tensors' bytes in order (the ``xxhash`` library; ~17 GB/s here, where
    zlib's CRC-32 ran at 2.7 GB/s and was the transfer's largest cost): a chunk's check.
    A corruption check, not a defence against a forger: the link is for trusted networks."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, t: torch.Tensor) -> None:
        self._h.update(t.reshape(-1).numpy())

    @staticmethod
    def empty() -> torch.Tensor:
        """A place to receive a digest."""
        return torch.zeros(1, dtype=torch.int64)

    def matches(self, received: torch.Tensor) -> bool:
        return int(self.tensor()[0]) == int(received[0])

    def tensor(self) -> torch.Tensor:
        """The digest as one int64 (signed), the form it travels in."""
        v = self._h.intdigest()
        return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v], dtype=torch.int64)


def tokens_hash(token_ids: list[int]) -> str:
    """A short hash of token ids: both ends check they speak of the same prompt."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def fingerprint(storage, keys: tuple) -> str:
    """What must match for one engine's pages to mean the same in another's: the KV hash
    keys (model, weights, dtypes, block size, scale kind, ...), every page tensor's shape
    and dtype, and the static scales' bytes."""
    shapes = [(tuple(t.shape[1:]), str(t.dtype)) for t in _tensors(storage)]
    static = hashlib.sha256()
    for scales in (storage.k_scale, storage.v_scale):
        for s in scales:
            if s.dim() < 3:
                static.update(s.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return hashlib.sha256(repr((keys, shapes, static.hexdigest())).encode()).hexdigest()[:32]


def layout_summary(storage, keys: tuple) -> dict:
    """The fingerprint's parts by name (what a refused handshake names as differing)."""
    out = {k: str(v) for k, v in keys}
    out["page_tensors"] = repr([(tuple(t.shape[1:]), str(t.dtype)) for t in _tensors(storage)])
    return out
