"""Per-group KV managers: the block tables of one KV cache group, one class per spec type.

:class:`~pagedkv.kv.manager.KVCacheManager` owns one of these per group and calls them in
the scheduler's order (lookup -> allocate -> publish -> free). Each decides, for its
spec, how many pages a request needs, which cached pages count as a prefix hit and
which pages it may give back early. The class comes from :data:`SPEC_MANAGER_MAP` by the
spec's exact type, so a new attention kind is a new class and a table entry, not a flag::

    FullAttentionSpec       -> FullAttentionManager    pages as the request grows
    ContiguousAttentionSpec -> ContiguousManager       prompt + max_tokens at admission
    SlidingWindowSpec       -> SlidingWindowManager    pages before the window go back

Prefix-cache entries are keyed ``(group_id, block_hash)``: two groups holding the same
tokens hold different layers' KV and must never hit each other's pages. Plain ints only.
"""

from __future__ import annotations

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.groups import ContiguousAttentionSpec, FullAttentionSpec, KVLayerSpec, SlidingWindowSpec
from pagedkv.kv.hashing import BlockHash


class FullAttentionManager:
    """Block tables of one full-attention group.

    Args:
        spec: the group's layer spec (its ``block_size``).
        group_id: the group's index, part of every prefix-cache key.
        pool: the shared page pool.
    """

    #: a prefix lookup stops at the first missing block (cheap): done before other groups'
    lookup_first = True
    #: pages given back before their request ended (a sliding window's), over the manager's life
    blocks_given_back = 0

    def __init__(self, spec: KVLayerSpec, group_id: int, pool: BlockPool) -> None:
        self.spec, self.group_id, self.pool = spec, group_id, pool
        self.block_size = spec.block_size
        self.block_tables: dict[str, list[int]] = {}
        self.num_published: dict[str, int] = {}
        self.compacted: set[str] = set()  # requests whose pages KV eviction rewrote: never published

    # ---- sizing ---------------------------------------------------------------------
    def tokens_to_hold(self, req, total_tokens: int) -> int:
        """Tokens ``req`` must have slots for once ``total_tokens`` are computed."""
        return total_tokens

    def peak_blocks(self, total_tokens: int, step_tokens: int) -> int:
        """The most pages a request of ``total_tokens`` holds at once when a step computes at
        most ``step_tokens`` of its tokens (all of its blocks, under full attention)."""
        return -(-total_tokens // self.block_size)

    def num_blocks_needed(self, req, total_tokens: int, num_hit_blocks: int) -> int:
        """New pages an allocation for ``total_tokens`` takes beyond the table and the hit."""
        held = len(self.block_tables.get(req.request_id, ())) + num_hit_blocks
        return max(0, -(-self.tokens_to_hold(req, total_tokens) // self.block_size) - held)

    # ---- prefix hits ----------------------------------------------------------------
    def find_longest_hit(self, hashes: list[BlockHash], tokens: list[int], max_blocks: int) -> list[int]:
        """Cached pages of the longest run of leading blocks, at most ``max_blocks``."""
        bs, blocks = self.block_size, []
        for i, h in enumerate(hashes[:max_blocks]):
            b = self.pool.lookup((self.group_id, h), tuple(tokens[i * bs:(i + 1) * bs]))
            if b is None:
                break
            blocks.append(b)
        return blocks

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, request_id: str, hit_blocks: list[int], num_new: int) -> list[int]:
        """Pin ``hit_blocks`` (a new request's prefix hit), then append ``num_new`` fresh
        pages; returns the pages added to the table (hit first)."""
        table = self.block_tables.setdefault(request_id, [])
        if hit_blocks:
            self.pool.touch([b for b in hit_blocks if b != self.pool.null_block])
            table.extend(hit_blocks)
            self.num_published[request_id] = len(hit_blocks)
        new = self.pool.allocate(num_new)
        table.extend(new)
        return list(hit_blocks) + new

    def cache_full_blocks(self, request_id: str, hashes: list[BlockHash], tokens: list[int],
                          num_written_tokens: int) -> None:
        """Publish the pages that are full once ``num_written_tokens`` have KV written (a
        null entry, a page a sliding window gave back after publishing it, is skipped)."""
        if request_id in self.compacted:  # the pages no longer hold the tokens their hashes name
            return
        start = self.num_published.get(request_id, 0)
        end = min(num_written_tokens // self.block_size, len(hashes))
        table, bs = self.block_tables[request_id], self.block_size
        for i in range(start, end):
            if table[i] != self.pool.null_block:
                self.pool.cache_block(table[i], (self.group_id, hashes[i]), tuple(tokens[i * bs:(i + 1) * bs]))
        self.num_published[request_id] = max(start, end)

    def trim(self, req, total_tokens: int) -> bool:
        """Give back the table's tail pages beyond what ``total_tokens`` need (never a
        published page); returns whether any went. Speculative decoding's rejected drafts."""
        table = self.block_tables.get(req.request_id)
        if not table:
            return False
        keep = max(-(-self.tokens_to_hold(req, total_tokens) // self.block_size),
                   self.num_published.get(req.request_id, 0))
        if keep >= len(table):
            return False
        dropped = table[keep:]
        del table[keep:]
        self.pool.release([b for b in reversed(dropped) if b != self.pool.null_block])
        return True

    def free(self, request_id: str) -> None:
        """Release the request's pages, tail first (so its tail is evicted first)."""
        table = self.block_tables.pop(request_id, [])
        self.pool.release([b for b in reversed(table) if b != self.pool.null_block])
        self.num_published.pop(request_id, None)
        self.compacted.discard(request_id)

    def _own_pages(self, request_id: str) -> list[int]:
        """The request's pages no other table holds."""
        return [b for b in self.block_tables[request_id] if b != self.pool.null_block and self.pool.ref_cnt[b] == 1]

    def can_compact(self, request_id: str, num_blocks: int) -> bool:
        """Whether :meth:`compact` can find ``num_blocks`` pages (fresh or the request's own)."""
        if type(self) is not FullAttentionManager:
            raise ValueError(f"{type(self).__name__} cannot compact a request's pages (full attention only)")
        return num_blocks <= self.pool.num_available + len(self._own_pages(request_id))

    def compact(self, request_id: str, num_blocks: int) -> int:
        """Give the request a table of ``num_blocks`` pages for its kept tokens: fresh ones
        when the pool has them (the old pages, released tail first, keep the prompt's KV
        for prefix hits), else its own pages first (unpublished: their contents change)
        and fresh ones for the rest. Returns the pages freed on net; check
        :meth:`can_compact` first."""
        old, null = self.block_tables[request_id], self.pool.null_block
        if num_blocks <= self.pool.num_available:
            new, gone = self.pool.allocate(num_blocks), old
        else:
            reused = self._own_pages(request_id)[:num_blocks]
            self.pool.forget(reused)
            new = reused + self.pool.allocate(num_blocks - len(reused))
            gone = [b for b in old if b not in set(reused)]
        self.block_tables[request_id] = new
        self.pool.release([b for b in reversed(gone) if b != null])
        self.num_published[request_id] = 0
        self.compacted.add(request_id)
        return sum(b != null for b in old) - num_blocks

    def remove_skipped(self, req, num_computed: int) -> int:
        """Give back pages no future query reads once ``num_computed`` tokens are computed
        (none under full attention). Returns how many went."""
        return 0

    def freeze_published(self) -> None:
        """Mark every held page as published (after a prefix-cache reset: none is re-hashed)."""
        for rid, table in self.block_tables.items():
            self.num_published[rid] = len(table)


class ContiguousManager(FullAttentionManager):
    """Full attention under the pre-paging allocator: reserve ``prompt + max_tokens``
    slots at admission (reads the request's ``num_prompt_tokens`` and ``max_tokens``)."""

    def tokens_to_hold(self, req, total_tokens: int) -> int:
        return max(total_tokens, req.num_prompt_tokens + req.max_tokens)


class SlidingWindowManager(FullAttentionManager):
    """Layers that attend to the last ``W = spec.sliding_window`` tokens: once ``c`` tokens
    are computed, the next query (position ``c``) reads positions ``c - W + 1 ..`` only, so
    every page wholly before that goes back to the pool (a published one stays findable
    there until it is evicted) and its table entry becomes the null page 0. A request then
    holds at most ``ceil(W / block_size) + 1`` pages plus those of the tokens it computes
    next. A prefix hit of ``n`` blocks needs only the pages the window of position
    ``n * block_size`` reads to be cached (the earlier entries of the hit are the null
    page), so hits survive the eviction of a long prompt's early pages."""

    lookup_first = False  # a lookup reads every block up to its cap: capped by the other groups' hits first

    def __init__(self, spec: SlidingWindowSpec, group_id: int, pool: BlockPool) -> None:
        super().__init__(spec, group_id, pool)
        self.window = int(spec.sliding_window)
        self.sink_blocks = -(-int(spec.num_sinks) // self.block_size)  # pages of attention sinks: kept
        self.num_skipped: dict[str, int] = {}
        self.blocks_given_back = 0  # pages returned early, over the manager's life

    def peak_blocks(self, total_tokens: int, step_tokens: int) -> int:
        """A step reads the ``W - 1`` positions before its first token and writes
        ``step_tokens``: at most that span's blocks, one more where it straddles a block."""
        span = -(-(self.window - 1 + step_tokens) // self.block_size) + 1 + self.sink_blocks
        return min(super().peak_blocks(total_tokens, step_tokens), span)

    def find_longest_hit(self, hashes: list[BlockHash], tokens: list[int], max_blocks: int) -> list[int]:
        """The longest hit of ``n <= max_blocks`` blocks whose last pages, those the window
        of position ``n * block_size`` reads, are all cached: those pages, after null
        entries for the blocks before them."""
        bs, cached = self.block_size, []
        for i, h in enumerate(hashes[:max_blocks]):
            cached.append(self.pool.lookup((self.group_id, h), tuple(tokens[i * bs:(i + 1) * bs])))
        sinks = self.sink_blocks
        if any(b is None for b in cached[:sinks]):
            return []
        run = 0  # cached blocks in a row ending at block n - 1
        best = 0
        for n in range(1, len(cached) + 1):
            run = run + 1 if cached[n - 1] is not None else 0
            if run >= max(1, n - max(sinks, (n * bs - self.window + 1) // bs)):  # at least one real page
                best = n
        first = max(sinks, max(0, best * bs - self.window + 1) // bs)
        return cached[:sinks] + [self.pool.null_block] * (first - sinks) + cached[first:best] if best else []

    def remove_skipped(self, req, num_computed: int) -> int:
        table = self.block_tables.get(req.request_id)
        if not table:
            return 0
        first = min(len(table), max(0, num_computed - self.window + 1) // self.block_size)
        start = self.num_skipped.get(req.request_id, self.sink_blocks)
        if first <= start:
            return 0
        null = self.pool.null_block
        gone = [table[i] for i in range(start, first) if table[i] != null]
        for i in range(start, first):
            table[i] = null
        self.pool.release(gone)
        self.num_skipped[req.request_id] = first
        self.blocks_given_back += len(gone)
        return len(gone)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.num_skipped.pop(request_id, None)


#: The manager class of each layer spec type (exact type: a subclass needs its own entry).
SPEC_MANAGER_MAP: dict[type, type[FullAttentionManager]] = {
    FullAttentionSpec: FullAttentionManager,
    ContiguousAttentionSpec: ContiguousManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def manager_for(spec: KVLayerSpec, group_id: int, pool: BlockPool) -> FullAttentionManager:
    """A manager for ``spec``'s group.

    Raises:
        ValueError: for a spec type with no manager.
    """
    cls = SPEC_MANAGER_MAP.get(type(spec))
    if cls is None:
        raise ValueError(f"no KV manager for {type(spec).__name__} yet; "
                                  f"known: {', '.join(t.__name__ for t in SPEC_MANAGER_MAP)}")
    return cls(spec, group_id, pool)
