"""Chained block hashes for prefix caching.

A full block's identity is ``sha256(parent_hash, token_ids, extra_keys)``: the hash of
block ``i`` covers every token of blocks ``0..i`` through the parent chain, and the extra
keys (model identity, weights version, KV dtype, a request's ``cache_salt``) keep two
caches that must not share apart. Every field is tagged and length-prefixed, so values
of different fields can never collide by concatenation (``("ab", "c")`` vs ``("a", "bc")``).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence

BlockHash = bytes  # 32-byte sha256 digest

ROOT_HASH: BlockHash = hashlib.sha256(b"pagedkv-root-v1").digest()


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def encode_extra_keys(extra_keys: Iterable[tuple[str, str]]) -> bytes:
    """Serialize tagged ``(field, value)`` pairs, sorted by field, unambiguously."""
    out = b""
    for name, value in sorted(extra_keys):
        out += _field(b"K", name.encode()) + _field(b"V", str(value).encode())
    return out


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes) -> BlockHash:
    """Hash of one full block given its parent's hash, its tokens and encoded extra keys."""
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    h = hashlib.sha256()
    h.update(_field(b"P", parent))
    h.update(_field(b"T", tokens))
    h.update(_field(b"X", extra))
    return h.digest()


def hash_blocks(token_ids: Sequence[int], block_size: int, extra: bytes,
                start: int = 0, parent: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent`` must be the hash of block ``start - 1`` (or ``ROOT_HASH`` when start is 0).
    A trailing partial block gets no hash: partly filled blocks are never shared.
    """
    hashes = []
    for b in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
