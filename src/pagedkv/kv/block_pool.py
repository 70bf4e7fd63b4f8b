"""BlockPool: the fixed set of KV pages, their ref counts and the prefix-cache hash map.

Every block is in exactly one of three states::

    free             ref 0, no hash       -> handed out first, FIFO
    cached-evictable ref 0, has a hash    -> still a prefix-cache hit; evicted in LRU order
    in use           ref > 0              -> held by one or more block tables

A block taken for new data leaves the hash map at once, so no entry ever points at a
block that holds other data. Page 0 is the null block: never handed out, never freed,
in none of the three states; a block-table entry whose page was given back early (a
sliding window's past) points at it. Usable pages are ``1..num_blocks``. Prefix-cache
keys are any hashable (the KV manager uses ``(group_id, block_hash)``). Plain ints only:
this module never imports torch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

BlockKey = Hashable  # a prefix-cache key: a block hash, or (group_id, block hash)


class BlockPool:
    """Pages ``1..num_blocks`` with ref counts, a free queue and an LRU evictable queue,
    plus the null page 0 (:attr:`null_block`); :attr:`num_pages` = ``num_blocks + 1``."""

    null_block = 0

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * self.num_pages
        self.block_hash: list[BlockKey | None] = [None] * self.num_pages
        self.block_tokens: list[tuple[int, ...] | None] = [None] * self.num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(self.block_ids)
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockKey, int] = {}
        self.num_evictions = 0

    @property
    def num_pages(self) -> int:
        """Pages the storage must hold: the usable ones and the null page."""
        return self.num_blocks + 1

    @property
    def block_ids(self) -> range:
        """Ids of the usable pages."""
        return range(1, self.num_blocks + 1)

    # ---- counts -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free plus cached-evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    # ---- allocation ---------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref count 1 each): free ones first, then evict LRU cached ones.

        Raises:
            RuntimeError: if fewer than ``n`` are available (callers check first).
        """
        if n > self.num_available:
            raise RuntimeError(f"asked for {n} blocks, {self.num_available} available")
        out = []
        for _ in range(n):
            if self._free:
                b, _ = self._free.popitem(last=False)
            else:
                b, _ = self._evictable.popitem(last=False)
                self._drop_hash(b)
                self.num_evictions += 1
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Add a reference to each block (a prefix hit); ref-0 blocks leave their queue."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del (self._evictable if self.block_hash[b] else self._free)[b]
            self.ref_cnt[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block, in the order given.

        Blocks reaching ref 0 join the free queue (no hash) or the tail of the LRU
        evictable queue (hashed), so pass a request's blocks tail first to have its
        tail evicted first.
        """
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} released more often than held")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                (self._evictable if self.block_hash[b] else self._free)[b] = None

    # ---- prefix-cache map -----------------------------------------------------------
    def lookup(self, block_hash: BlockKey, token_ids: tuple[int, ...]) -> int | None:
        """The block cached under ``block_hash`` if it holds exactly ``token_ids``."""
        b = self._hash_to_block.get(block_hash)
        return b if b is not None and self.block_tokens[b] == token_ids else None

    def cache_block(self, block: int, block_hash: BlockKey, token_ids: tuple[int, ...]) -> None:
        """Publish an in-use, fully written block under ``block_hash``.

        A hash already held by another block is left pointing there (the duplicate
        stays private and is freed, not cached, when released).
        """
        if self.block_hash[block] is not None or block_hash in self._hash_to_block:
            return
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tuple(token_ids)
        self._hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached-evictable block's hash; returns how many were dropped.
        Hashes of in-use blocks are dropped too, so no new request hits them."""
        for b in list(self._evictable):
            self._evictable.pop(b)
            self._free[b] = None
        dropped = 0
        for b in self.block_ids:
            if self.block_hash[b] is not None:
                self._drop_hash(b)
                dropped += 1
        return dropped

    def forget(self, blocks: list[int]) -> None:
        """Unpublish in-use ``blocks`` whose contents are about to change (no lookup finds them)."""
        for b in blocks:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} is not in use")
            self._drop_hash(b)

    def _drop_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self._hash_to_block.get(h) == block:
            del self._hash_to_block[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None

    # ---- invariants -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the three-way split or the hash map is inconsistent."""
        free, evict = set(self._free), set(self._evictable)
        assert not free & evict, f"blocks both free and evictable: {free & evict}"
        assert self.ref_cnt[self.null_block] == 0 and self.block_hash[self.null_block] is None, "null block in use"
        assert self.null_block not in free and self.null_block not in evict, "null block queued"
        for b in self.block_ids:
            in_use = self.ref_cnt[b] > 0
            assert in_use + (b in free) + (b in evict) == 1, f"block {b} not in exactly one state"
            assert self.ref_cnt[b] >= 0, f"block {b} ref count {self.ref_cnt[b]}"
            if b in free:
                assert self.block_hash[b] is None, f"free block {b} still has a hash"
            if b in evict:
                assert self.block_hash[b] is not None, f"evictable block {b} has no hash"
        for h, b in self._hash_to_block.items():
            assert self.block_hash[b] == h, f"hash entry points at block {b} holding other data"
        assert self.num_available + sum(r > 0 for r in self.ref_cnt) == self.num_blocks
