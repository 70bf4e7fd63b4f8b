"""KVCacheManager: per-request block tables on top of a BlockPool.

A request's block table lists its pages in token order. Token ``t`` of the request
lives in slot ``table[t // block_size] * block_size + t % block_size``::

    | prefix hit (shared, read-only) | computed | new (this step) | unallocated |
    ^0                               ^hit       ^num_computed     ^+num_new

The scheduler's call order is the contract: ``get_computed_blocks`` (prefix lookup, only
for a request with nothing computed) -> derive the tokens to schedule from the hit ->
``allocate_slots`` (pins the hit blocks, takes new ones) -> the model writes the KV ->
``cache_full_blocks`` publishes the newly full blocks -> ``free`` on finish, abort or
preemption (tail first, so the tail is evicted first). Plain ints; no torch.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Protocol, Sequence

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.hashing import ROOT_HASH, BlockHash, encode_extra_keys, hash_blocks


class CacheRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    num_prompt_tokens: int  # read only by the contiguous allocator
    max_tokens: int         # read only by the contiguous allocator


class ComputedBlocks(NamedTuple):
    """Result of a prefix lookup: the hit blocks and the tokens they hold."""
    blocks: list[int]
    num_tokens: int


class KVUsage(NamedTuple):
    """Blocks by state; ``used + cached + free == total``."""
    used: int
    cached: int
    free: int
    total: int


class KVCacheManager:
    """Allocates, publishes and frees the pages of each request.

    Args:
        num_blocks: pages in the pool.
        block_size: token slots per page.
        enable_prefix_caching: look up and publish full blocks by chained hash.
        extra_keys: tagged ``(field, value)`` pairs every block hash includes
            (model identity, weights version, KV dtype).
        allocator: ``"paged"`` takes pages as a request grows; ``"contiguous"`` is the
            pre-paging baseline (FasterTransformer, Orca): at admission it reserves pages
            for ``prompt + max_tokens`` tokens at once, so unused output slots are wasted.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_keys: Sequence[tuple[str, str]] = (), allocator: str = "paged") -> None:
        if allocator not in ("paged", "contiguous"):
            raise ValueError(f"allocator must be 'paged' or 'contiguous', got {allocator!r}")
        self.pool = BlockPool(num_blocks)
        self.allocator = allocator
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_keys = tuple(extra_keys)
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_published: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up, counted when a lookup is admitted
        self.prefix_hits = 0     # tokens found

    # ---- lookup and allocation ------------------------------------------------------
    def get_computed_blocks(self, req: CacheRequest) -> ComputedBlocks:
        """Longest cached prefix of ``req`` in whole blocks, leaving >= 1 token to compute
        (the last token's logits are needed). Does not pin: pass the result to
        ``allocate_slots`` in the same scheduling step."""
        if not self.enable_prefix_caching or req.num_computed_tokens or _wants_prompt_logits(req):
            return ComputedBlocks([], 0)
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        blocks = []
        for i, h in enumerate(self._block_hashes(req)[:max_blocks]):
            b = self.pool.lookup(h, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))
            if b is None:
                break
            blocks.append(b)
        return ComputedBlocks(blocks, len(blocks) * self.block_size)

    def blocks_needed(self, req: CacheRequest, num_new_tokens: int, hit: ComputedBlocks) -> int:
        """New blocks ``allocate_slots`` would take, beyond the table and the hit."""
        total = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        if self.allocator == "contiguous":
            total = max(total, req.num_prompt_tokens + req.max_tokens)
        held = len(self.block_tables.get(req.request_id, ())) + len(hit.blocks)
        return max(0, -(-total // self.block_size) - held)

    def allocate_slots(self, req: CacheRequest, num_new_tokens: int,
                       hit: ComputedBlocks = ComputedBlocks([], 0)) -> bool:
        """Pin ``hit`` and allocate pages for ``num_new_tokens`` more tokens.

        Returns False, changing nothing, when the pool cannot supply them.
        """
        need = self.blocks_needed(req, num_new_tokens, hit)
        hit_evictable = sum(1 for b in hit.blocks if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_available - hit_evictable:
            return False
        table = self.block_tables.setdefault(req.request_id, [])
        if not table and self.enable_prefix_caching:  # first allocation: count the lookup once
            self.prefix_queries += len(req.all_token_ids)
            self.prefix_hits += hit.num_tokens
        if hit.blocks:
            self.pool.touch(hit.blocks)
            table.extend(hit.blocks)
            self._num_published[req.request_id] = len(hit.blocks)
        table.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, req: CacheRequest, num_written_tokens: int) -> None:
        """Publish the blocks of ``req`` that are full once ``num_written_tokens`` tokens
        have their KV written. Call only after the step that writes them."""
        if not self.enable_prefix_caching:
            return
        start = self._num_published.get(req.request_id, 0)
        end = num_written_tokens // self.block_size
        if end <= start:
            return
        hashes, table, tokens = self._block_hashes(req), self.block_tables[req.request_id], req.all_token_ids
        for i in range(start, end):
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            self.pool.cache_block(table[i], hashes[i], block_tokens)
        self._num_published[req.request_id] = end

    def free(self, request_id: str) -> None:
        """Release every page of the request, tail first. Unknown ids are ignored."""
        table = self.block_tables.pop(request_id, [])
        self.pool.release(list(reversed(table)))
        self._hashes.pop(request_id, None)
        self._num_published.pop(request_id, None)

    def reset_prefix_cache(self) -> int:
        for rid, table in self.block_tables.items():  # in-use blocks stay unpublished
            self._num_published[rid] = len(table)
        return self.pool.reset_prefix_cache()

    # ---- helpers --------------------------------------------------------------------
    def _block_hashes(self, req: CacheRequest) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended as it grows."""
        hashes = self._hashes.setdefault(req.request_id, [])
        if len(hashes) < len(req.all_token_ids) // self.block_size:
            keys = self.extra_keys + ((("cache_salt", req.cache_salt),) if req.cache_salt else ())
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.extend(hash_blocks(req.all_token_ids, self.block_size, encode_extra_keys(keys),
                                      start=len(hashes), parent=parent))
        return hashes

    def slot(self, request_id: str, position: int) -> int:
        """Flat cache slot of token ``position`` of the request."""
        table = self.block_tables[request_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_usage(self, num_written: dict[str, int]) -> tuple[int, int]:
        """``(allocated, filled)`` token slots over blocks held by requests, shared blocks
        counted once; ``num_written`` maps request id -> tokens whose KV is written.
        KV memory waste is ``1 - filled / allocated``."""
        filled: dict[int, int] = {}
        for rid, table in self.block_tables.items():
            n = num_written.get(rid, 0)
            for i, b in enumerate(table):
                filled[b] = max(filled.get(b, 0), min(self.block_size, max(0, n - i * self.block_size)))
        return len(filled) * self.block_size, sum(filled.values())

    def usage(self) -> KVUsage:
        p = self.pool
        return KVUsage(p.num_used, p.num_evictable, p.num_free, p.num_blocks)

    def check_invariants(self) -> None:
        """Pool invariants plus: ref counts equal the number of tables holding each block."""
        self.pool.check_invariants()
        held = Counter(b for table in self.block_tables.values() for b in table)
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_cnt[b] == held[b], (
                f"block {b}: ref count {self.pool.ref_cnt[b]} but held by {held[b]} tables")


def _wants_prompt_logits(req) -> bool:
    """A request asking for prompt logprobs must compute its whole prompt."""
    params = getattr(req, "sampling_params", None)
    return getattr(params, "prompt_logprobs", None) is not None
