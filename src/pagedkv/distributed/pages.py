"""Pages as bytes: what a KV transfer moves, and the check that it arrived whole.

A page's bytes are, layer by layer, its K, its V and (int8/fp8 per-token-head pages) their
scales: every tensor :meth:`~pagedkv.kv.storage.KVCacheStorage.page_tensors` indexes by page,
so quantized pages travel with their scales. Static (per-head, per-tensor) scales are the
layer's, not the page's: both ends calibrate them on the same text, and the link's
:func:`fingerprint` makes sure they hold the same ones.
"""

from __future__ import annotations

import hashlib
import zlib

import torch


def _tensors(storage) -> list[torch.Tensor]:
    """Each page-indexed tensor once (layers sharing page tensors give them once)."""
    unique = {id(t): t for layer in range(storage.num_layers) for t in storage.page_tensors(layer)}
    return list(unique.values())


class PageLayout:
    """Reads and writes whole pages of one storage as bytes, through caller-owned buffers
    (a transfer reuses one staging buffer instead of allocating per request)."""

    def __init__(self, storage) -> None:
        self.tensors = _tensors(storage)
        self.page_bytes = sum(t[0].numel() * t.element_size() for t in self.tensors)

    def _views(self, n: int, buf: torch.Tensor):
        """Each page tensor beside its part of ``buf``, both of one dtype: one-byte dtypes
        (int8, fp8) as bytes, since CPU index_copy_ has no fp8 kernel."""
        off = 0
        for t in self.tensors:
            size = n * t[0].numel() * t.element_size()
            if t.element_size() == 1:
                t = t.view(torch.uint8)
            yield t, buf[off:off + size].view(t.dtype).view(n, *t.shape[1:])
            off += size

    def read(self, page_ids: list[int], out: torch.Tensor) -> torch.Tensor:
        """Copy ``page_ids``' bytes into ``out`` (uint8, at least ``len(page_ids) * page_bytes``);
        returns the part used."""
        n, idx = len(page_ids), torch.tensor(page_ids, dtype=torch.int64)
        out = out[:n * self.page_bytes]
        for t, view in self._views(n, out):
            torch.index_select(t, 0, idx, out=view)
        return out

    def write(self, page_ids: list[int], data: torch.Tensor) -> None:
        """Store bytes made by :meth:`read` (of a storage of the same layout) into ``page_ids``.

        Raises:
            ValueError: ``data`` is not exactly that many pages' bytes.
        """
        n, idx = len(page_ids), torch.tensor(page_ids, dtype=torch.int64)
        if data.numel() != n * self.page_bytes:
            raise ValueError(f"{data.numel()} bytes do not hold {n} pages of this cache ({n * self.page_bytes} bytes)")
        for t, view in self._views(n, data):
            t.index_copy_(0, idx, view)


def staging(buf: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """``buf`` if it holds ``nbytes``, else a new uint8 buffer of that size."""
    return buf if buf is not None and buf.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)


def checksum(data: torch.Tensor) -> int:
    """CRC-32 of a uint8 tensor's bytes."""
    return zlib.crc32(data.numpy())


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
