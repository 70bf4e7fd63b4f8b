"""KVCacheManager: per-request block tables for every KV cache group, on one BlockPool.

A request has one block table per KV cache group (:mod:`pagedkv.kv.groups`); each group's
tables are kept by a manager chosen from the group's spec type
(:mod:`pagedkv.kv.single_type`). Token ``t`` of a request lives, in the layers of group
``g``, in slot ``table_g[t // block_size] * block_size + t % block_size`` (:mod:`pagedkv.kv.slots`)::

    | prefix hit (shared, read-only) | computed | new (this step) | unallocated |
    ^0                               ^hit       ^num_computed     ^+num_new

The scheduler's call order is the contract: ``get_computed_blocks`` (prefix lookup, only
for a request with nothing computed) -> derive the tokens to schedule from the hit ->
``allocate_slots`` (pins the hit blocks, takes new ones; all groups or none) -> the model
writes the KV -> ``cache_full_blocks`` publishes the newly full blocks -> ``free`` on
finish, abort or preemption (tail first, so the tail is evicted first). Page 0 is the
null block: table entries whose page was given back point at it. Plain ints; no torch.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple, Protocol, Sequence

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.groups import KVCacheGroup, single_group
from pagedkv.kv.hashing import ROOT_HASH, BlockHash, encode_extra_keys, hash_blocks
from pagedkv.kv.single_type import FullAttentionManager, manager_for
from pagedkv.kv.slots import slot


class CacheRequest(Protocol):
    """What the manager reads of a request (a request may also have ``num_evicted_tokens``:
    tokens KV eviction compacted away, so its pages hold ``num_computed - num_evicted``)."""
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None


def cached_tokens(req: CacheRequest) -> int:
    """Tokens of ``req`` with KV in its pages: computed ones less those eviction dropped."""
    return req.num_computed_tokens - getattr(req, "num_evicted_tokens", 0)


class ComputedBlocks(NamedTuple):
    """Result of a prefix lookup: the hit pages of each group (``()`` = no hit) and the
    tokens they hold."""
    blocks: tuple[list[int], ...]
    num_tokens: int


NO_HIT = ComputedBlocks((), 0)


class KVUsage(NamedTuple):
    """Blocks by state; ``used + cached + free == total`` (the null block is not counted)."""
    used: int
    cached: int
    free: int
    total: int


class KVCacheManager:
    """Allocates, publishes and frees the pages of each request in every group.

    Args:
        num_blocks: usable pages in the pool (the null page 0 comes on top).
        block_size: token slots per page.
        enable_prefix_caching: look up and publish full blocks by chained hash.
        extra_keys: tagged ``(field, value)`` pairs every block hash includes
            (model identity, weights version, KV dtype).
        kv_groups: the KV cache groups; default one full-attention group.

    Raises:
        ValueError: a group whose block size is not ``block_size``, or a spec type with
            no manager.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_keys: Sequence[tuple[str, str]] = (),
                 kv_groups: Sequence[KVCacheGroup] | None = None) -> None:
        self.kv_groups = tuple(kv_groups) if kv_groups else single_group(1, block_size)
        if any(g.spec.block_size != block_size for g in self.kv_groups):
            raise ValueError(f"every KV group must use block_size {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_keys = tuple(extra_keys)
        self.groups: list[FullAttentionManager] = [manager_for(g.spec, i, self.pool)
                                                   for i, g in enumerate(self.kv_groups)]
        self._hashes: dict[str, list[BlockHash]] = {}
        # the one group when it is plain full attention (no skipped pages, tokens held = computed):
        # the decode steps whose last page has room then skip the general path
        only = self.groups[0] if len(self.groups) == 1 else None
        self._plain = only if type(only) is FullAttentionManager else None
        self.prefix_queries = 0  # tokens looked up, counted when a lookup is admitted
        self.prefix_hits = 0     # tokens found

    # ---- lookup and allocation ------------------------------------------------------
    def get_computed_blocks(self, req: CacheRequest, max_hit_tokens: int | None = None) -> ComputedBlocks:
        """Longest cached prefix of ``req`` in whole blocks present in every group,
        leaving >= 1 token to compute (the last token's logits are needed) and holding at
        most ``max_hit_tokens`` (KV eviction's scores need some queries computed). Does not
        pin: pass the result to ``allocate_slots`` in the same scheduling step."""
        if not self.enable_prefix_caching or req.num_computed_tokens or _wants_prompt_logits(req):
            return NO_HIT
        cap = len(req.all_token_ids) - 1
        if max_hit_tokens is not None:
            cap = min(cap, max_hit_tokens)
        max_blocks = max(0, cap) // self.block_size
        hashes = self.block_hashes(req)
        hits: list[list[int]] = [[] for _ in self.groups]
        for i in sorted(range(len(self.groups)), key=lambda i: not self.groups[i].lookup_first):
            if max_blocks:  # each group's hit caps the next lookups: a window group reads every block up to
                hits[i] = self.groups[i].find_longest_hit(hashes, req.all_token_ids, max_blocks)  # its cap
                max_blocks = min(max_blocks, len(hits[i]))
        n = min(len(h) for h in hits)
        while n and any(len(h) != n for h in hits):  # a group hit less: look up n again in every group, since
            hits = [g.find_longest_hit(hashes, req.all_token_ids, n) for g in self.groups]  # the pages a window
            n = min(len(h) for h in hits)  # group needs depend on n (a longer hit's null entries, cut, are not)
        return ComputedBlocks(tuple(hits), n * self.block_size) if n else NO_HIT

    def blocks_needed(self, req: CacheRequest, num_new_tokens: int, hit: ComputedBlocks = NO_HIT) -> int:
        """New pages ``allocate_slots`` would take over all groups, beyond tables and hit."""
        total = cached_tokens(req) + hit.num_tokens + num_new_tokens
        return sum(g.num_blocks_needed(req, total, len(_group_hit(hit, i)))
                   for i, g in enumerate(self.groups))

    def peak_blocks(self, total_tokens: int, step_tokens: int) -> int:
        """The most pages (all groups) one request of ``total_tokens`` holds at once when a
        step computes at most ``step_tokens`` of them: whether it can ever run in this pool."""
        return sum(g.peak_blocks(total_tokens, step_tokens) for g in self.groups)

    def allocate_slots(self, req: CacheRequest, num_new_tokens: int, hit: ComputedBlocks = NO_HIT) -> bool:
        """Pin ``hit`` and allocate pages for ``num_new_tokens`` more tokens in every group.
        Pages a sliding window no longer reads go back first (whatever the outcome).

        Returns False, allocating nothing, when the pool cannot supply them all.
        """
        if self._plain is not None and not hit.num_tokens:  # (once per request and step: written for speed)
            table = self._plain.block_tables.get(req.request_id)
            if table is not None and cached_tokens(req) + num_new_tokens <= len(table) * self.block_size:
                return True
        groups = self.groups
        for g in groups:
            g.remove_skipped(req, req.num_computed_tokens)
        total = cached_tokens(req) + hit.num_tokens + num_new_tokens
        if not hit.num_tokens:
            needs = [g.num_blocks_needed(req, total, 0) for g in groups]
            if not any(needs) and req.request_id in groups[0].block_tables:
                return True  # (most decode steps: the last page has room)
        else:
            needs = [g.num_blocks_needed(req, total, len(_group_hit(hit, i))) for i, g in enumerate(self.groups)]
        null = self.pool.null_block
        hit_evictable = len({b for blocks in hit.blocks for b in blocks if b != null and self.pool.ref_cnt[b] == 0})
        if sum(needs) > self.pool.num_available - hit_evictable:
            return False
        if req.request_id not in self.groups[0].block_tables and self.enable_prefix_caching:
            self.prefix_queries += len(req.all_token_ids)  # first allocation: count the lookup once
            self.prefix_hits += hit.num_tokens
        for i, g in enumerate(self.groups):  # every group's hit pinned before any group takes new pages,
            g.allocate(req.request_id, _group_hit(hit, i), 0)  # which could evict another group's hit
        for g, need in zip(self.groups, needs):
            g.allocate(req.request_id, [], need)
            if hit.num_tokens:
                g.remove_skipped(req, req.num_computed_tokens + hit.num_tokens)
        return True

    def cache_full_blocks(self, req: CacheRequest, num_written_tokens: int) -> None:
        """Publish the blocks of ``req`` that are full once ``num_written_tokens`` tokens
        have their KV written. Call only after the step that writes them."""
        if not self.enable_prefix_caching or num_written_tokens < self.block_size:
            return
        full, rid = num_written_tokens // self.block_size, req.request_id
        for g in self.groups:
            if g.num_published.get(rid, 0) < full:
                break
        else:
            return  # no page filled since the last call (most decode steps)
        hashes = self.block_hashes(req)
        for g in self.groups:
            g.cache_full_blocks(req.request_id, hashes, req.all_token_ids, num_written_tokens)

    def compact(self, req: CacheRequest, num_kept: int) -> int:
        """KV eviction: give ``req`` tables of ``ceil(num_kept / block_size)`` pages in every
        group, into which the runner copies the kept tokens' KV in order (fresh pages when
        the pool has them, else its own: :meth:`FullAttentionManager.compact`); the others
        go back. Its pages are never published again. Returns the pages freed on net, or
        -1, changing nothing, when no group can find the pages (other tables share them
        and the pool is empty).

        Raises:
            ValueError: for a group whose manager cannot compact (sliding window, contiguous).
        """
        need = -(-num_kept // self.block_size)
        if len(self.groups) > 1 and need * len(self.groups) > self.pool.num_available:
            return -1  # groups share the pool: only fresh pages for all of them at once
        if not all(g.can_compact(req.request_id, need) for g in self.groups):
            return -1
        return sum(g.compact(req.request_id, need) for g in self.groups)

    def trim(self, req: CacheRequest, num_tokens: int) -> bool:
        """Give back pages beyond what ``num_tokens`` tokens need, in every group (pages that
        held only rejected draft positions). Returns whether any page went."""
        return any([g.trim(req, num_tokens) for g in self.groups])

    def free(self, request_id: str) -> None:
        """Release every page of the request in every group, tail first. Unknown ids are ignored."""
        for g in self.groups:
            g.free(request_id)
        self._hashes.pop(request_id, None)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block (in-use blocks stay, unpublished). Returns the count."""
        for g in self.groups:
            g.freeze_published()
        return self.pool.reset_prefix_cache()

    # ---- tables ----------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in each group (empty lists if it holds none)."""
        if self._plain is not None:
            return (self._plain.block_tables.get(request_id, []),)
        return tuple([g.block_tables.get(request_id, []) for g in self.groups])

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Group 0's tables (the only group of a full-attention model), by request id."""
        return self.groups[0].block_tables

    def block_hashes(self, req: CacheRequest) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended as it grows."""
        hashes = self._hashes.setdefault(req.request_id, [])
        if len(hashes) < len(req.all_token_ids) // self.block_size:
            keys = self.extra_keys + ((("cache_salt", req.cache_salt),) if req.cache_salt else ())
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.extend(hash_blocks(req.all_token_ids, self.block_size, encode_extra_keys(keys),
                                      start=len(hashes), parent=parent))
        return hashes

    def slot(self, request_id: str, position: int, group: int = 0) -> int:
        """Flat cache slot of token ``position`` of the request in ``group``'s layers."""
        return slot(self.groups[group].block_tables[request_id], position, self.block_size)

    # ---- accounting ---------------------------------------------------------------------
    def slot_usage(self, num_written: dict[str, int]) -> tuple[int, int]:
        """``(allocated, filled)`` token slots over pages held by requests in any group,
        shared pages counted once; ``num_written`` maps request id -> tokens whose KV is
        written. KV memory waste is ``1 - filled / allocated``.

        A page is full if some table holds it before that request's written tokens end,
        else it holds the most any table wrote into it. Only each table's tail (from its
        first page not wholly written) is read: by the invariant :meth:`check_invariants`
        checks, a page's ref count is the number of table entries holding it, so a page
        is in no written part exactly when all its entries are tail entries, and the pages
        held are the pool's used ones. O(tables) a call, not O(entries): a window group's
        table keeps an entry (the null page) for every page it gave back."""
        bs, pool = self.block_size, self.pool
        tails: list[int] = []
        partial: dict[int, int] = {}
        get = num_written.get
        for g in self.groups:  # (every step, over every table: written for speed)
            for rid, table in g.block_tables.items():
                n = get(rid, 0)
                k = n // bs if n > 0 else 0
                if k < len(table):
                    tails += table[k:]
                    r = n - k * bs
                    if r > 0 and r > partial.get(table[k], 0):
                        partial[table[k]] = r
        only = [b for b, c in Counter(tails).items() if b != pool.null_block and pool.ref_cnt[b] == c]
        return pool.num_used * bs, bs * (pool.num_used - len(only)) + sum(partial.get(b, 0) for b in only)

    @property
    def blocks_given_back(self) -> int:
        """Pages every group gave back before their request ended (sliding windows)."""
        return sum(g.blocks_given_back for g in self.groups)

    def usage(self) -> KVUsage:
        p = self.pool
        return KVUsage(p.num_used, p.num_evictable, p.num_free, p.num_blocks)

    def check_invariants(self) -> None:
        """Pool invariants plus: ref counts equal the number of tables (any group) holding
        each page; the null page is held by no count; no page is in two groups' tables."""
        self.pool.check_invariants()
        null = self.pool.null_block
        held = Counter(b for g in self.groups for t in g.block_tables.values() for b in t if b != null)
        for b in self.pool.block_ids:
            assert self.pool.ref_cnt[b] == held[b], (
                f"block {b}: ref count {self.pool.ref_cnt[b]} but held by {held[b]} tables")
        owner: dict[int, int] = {}  # a page is one group's (groups may share page tensors)
        for i, g in enumerate(self.groups):
            for rid, t in g.block_tables.items():
                for b in t:
                    ok = b == null or owner.setdefault(b, i) == i
                    assert ok, f"block {b} in group {owner.get(b)} and {i} ({rid})"


def _group_hit(hit: ComputedBlocks, group: int) -> list[int]:
    return hit.blocks[group] if hit.blocks else []


def _wants_prompt_logits(req) -> bool:
    """A request asking for prompt logprobs must compute its whole prompt."""
    params = getattr(req, "sampling_params", None)
    return getattr(params, "prompt_logprobs", None) is not None
