"""TierIndex: which prefix blocks a lower KV tier holds, in which of its slots.

Plain Python, no tensors: the CPU tier (:mod:`pagedkv.connectors.offload.cpu_tier`) keeps the bytes,
this keeps the bookkeeping. Entries are keyed by the device's chained block hash (which
already covers the model, weights, dtypes, scales, block size and a request's salt), and
an entry remembers its parent hash and token ids (a hit must also match the tokens).

**Chain consistency**: the tier is prefix-closed. A block is stored only if it is the first
of its chain or its parent is resident; an entry with a resident child is never evicted,
so eviction takes chains tail first, and :meth:`match` never reports a block after a gap.

Entry states: *pending* (a save is in flight: invisible to lookups, not evictable), then
*ready*; a ready entry may be *pinned* (a load or a swapped-out request reads it: not
evictable). Victims are the unpinned ready leaves, least recently used first (``lru``) or
least often hit first (``lfu``, ties by age).

Besides entries, slots can be *held* outside the index (:meth:`acquire`): a swapped-out
request's pages that are no prefix block of the tier (its partial last block, blocks past
the tier's run), until :meth:`release`.

Invariant (:meth:`check_invariants`): free + resident + held == capacity; every resident
entry's parent is resident or the chain root; child counts and slot maps agree.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedkv.kv.hashing import ROOT_HASH, BlockHash

POLICIES = ("lru", "lfu")


@dataclass
class TierEntry:
    slot: int
    parent: BlockHash
    token_ids: tuple[int, ...]
    ready: bool = False
    pins: int = 0
    children: int = 0
    hits: int = 0
    step: int = 0  # the step whose save wrote it


class FreeSlots:
    """The free slots of ``0..capacity-1``, without a list of them all: slots never used yet
    are a counter, slots given back a stack taken first. The order is a stack of every slot
    with the lowest on top (the slot given back last, else the lowest never used), and the
    memory is that of the slots given back: a simulated 100 TB tier of 2 MB pages listed
    its 5e7 free slots up front (~2 GB)."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self._fresh, self._back = capacity, 0, []

    def __len__(self) -> int:
        return len(self._back) + self.capacity - self._fresh

    def pop(self) -> int:
        if self._back:
            return self._back.pop()
        if self._fresh >= self.capacity:
            raise IndexError("no free tier slot")
        self._fresh += 1
        return self._fresh - 1

    def append(self, slot: int) -> None:
        self._back.append(slot)

    def slots(self) -> list[int]:
        """Every free slot (for invariant checks: as long as the capacity)."""
        return self._back + list(range(self._fresh, self.capacity))


class TierIndex:
    """Slots ``0..capacity-1`` of one tier.

    Args:
        capacity: slots of the tier.
        policy: ``lru`` or ``lfu``.
        track_evictions: keep evicted hashes for :meth:`take_evicted` (a tier whose
            evictions remove something elsewhere, e.g. disk records).

    Raises:
        ValueError: a capacity under 1 or an unknown policy.
    """

    def __init__(self, capacity: int, policy: str = "lru", track_evictions: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"a KV tier needs at least one block, got {capacity}")
        if policy not in POLICIES:
            raise ValueError(f"kv_offload_policy must be one of {POLICIES}, got {policy!r}")
        self.capacity, self.policy = capacity, policy
        self.entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()  # LRU order, oldest first
        self._free = FreeSlots(capacity)
        self.num_evictions = 0
        self.track_evictions = track_evictions
        self._evicted: list[BlockHash] = []
        self._held: set[int] = set()

    # ---- lookup -----------------------------------------------------------------------
    def match(self, hashes: list[BlockHash], token_ids: list[int], block_size: int, first: int,
              max_blocks: int) -> list[TierEntry]:
        """Ready entries for blocks ``first, first + 1, ...`` (below ``max_blocks``) until the
        first block the tier does not hold with exactly these tokens."""
        out = []
        for i in range(first, min(max_blocks, len(hashes))):
            e = self.entries.get(hashes[i])
            if e is None or not e.ready or e.token_ids != tuple(token_ids[i * block_size:(i + 1) * block_size]):
                break
            out.append(e)
        return out

    def pin(self, entries: list[TierEntry]) -> None:
        for e in entries:
            e.pins += 1

    def unpin(self, entries: list[TierEntry]) -> None:
        for e in entries:
            if e.pins <= 0:
                raise RuntimeError("tier entry unpinned more often than pinned")
            e.pins -= 1

    def touch(self, block_hash: BlockHash, hit: bool = False) -> None:
        """Mark an entry as just used (LRU) and, for a hit, count it (LFU)."""
        e = self.entries.get(block_hash)
        if e is not None:
            self.entries.move_to_end(block_hash)
            e.hits += int(hit)

    # ---- storing ----------------------------------------------------------------------
    def reserve(self, block_hash: BlockHash, parent: BlockHash, token_ids: tuple[int, ...], step: int,
                evict: bool = True) -> int | None:
        """A slot for a new pending entry, evicting a victim if the tier is full (and
        ``evict``); None when the block is already held, its parent is not resident, or no
        slot can be had. Evicted hashes are kept for :meth:`take_evicted`."""
        if block_hash in self.entries or (parent != ROOT_HASH and parent not in self.entries):
            return None
        if parent != ROOT_HASH:  # counted first: the parent is no leaf, so never the victim
            self.entries[parent].children += 1
        if not self._free and not (evict and self._evict_one()):
            if parent != ROOT_HASH:
                self.entries[parent].children -= 1
            return None
        slot = self._free.pop()
        self.entries[block_hash] = TierEntry(slot, parent, tuple(token_ids), step=step)
        return slot

    def complete(self, up_to_step: int, failed: bool = False) -> list[BlockHash]:
        """Saves of steps up to ``up_to_step`` ended: their entries become ready, or are
        dropped if ``failed`` (the step raised; what it wrote is unknown). Pending entries
        of earlier steps that were never confirmed are dropped too. Returns the hashes
        that became ready, parents first."""
        ready = []
        for h, e in list(self.entries.items()):
            if h in self.entries and not e.ready and e.step <= up_to_step:
                if failed or e.step < up_to_step:
                    self._drop(h)
                else:
                    e.ready = True
                    ready.append(h)
        return ready

    def mark_ready(self, block_hash: BlockHash) -> None:
        """A pending entry's write ended (tiers whose writes end one by one, e.g. disk)."""
        self.entries[block_hash].ready = True

    def drop(self, block_hash: BlockHash) -> None:
        """Remove an entry whose write failed or whose record failed a check (with its
        descendants: a chain never keeps a block past a gap)."""
        self._drop(block_hash)

    def acquire(self, n: int) -> list[int] | None:
        """``n`` slots held outside the index (evicting victims as needed), or None, taking
        nothing, when fewer can be had."""
        if not self.can_acquire(n):
            return None
        while len(self._free) < n:
            if not self._evict_one():  # cannot happen after the count above; stay safe
                return None
        slots = [self._free.pop() for _ in range(n)]
        self._held.update(slots)
        return slots

    def release(self, slots: list[int]) -> None:
        """Give back slots from :meth:`acquire`."""
        for s in slots:
            self._held.remove(s)
            self._free.append(s)

    def can_acquire(self, n: int, keep: list[TierEntry] = ()) -> bool:
        """Whether :meth:`acquire` could take ``n`` slots with ``keep`` pinned too."""
        return n <= len(self._free) + self._num_evictable({id(e) for e in keep})

    def _num_evictable(self, keep: set[int] = frozenset()) -> int:
        """Entries evictions could free one leaf at a time: the ready, unpinned entries
        (not in ``keep``, by id) with no pinned or pending descendant."""
        blocked = {h for h, e in self.entries.items() if e.pins or not e.ready or id(e) in keep}
        for h in list(blocked):
            p = self.entries[h].parent
            while p in self.entries and p not in blocked:
                blocked.add(p)
                p = self.entries[p].parent
        return len(self.entries) - len(blocked)

    def take_evicted(self) -> list[BlockHash]:
        """Hashes evicted since the last call (a disk tier removes their records)."""
        out, self._evicted = self._evicted, []
        return out

    def _victim(self) -> BlockHash | None:
        leaves = ((h, e) for h, e in self.entries.items() if e.ready and not e.pins and not e.children)
        if self.policy == "lru":
            return next((h for h, _ in leaves), None)
        best = min(leaves, key=lambda he: he[1].hits, default=None)  # min keeps the oldest of a tie
        return best[0] if best else None

    def _evict_one(self) -> bool:
        h = self._victim()
        if h is None:
            return False
        self._drop(h)
        if self.track_evictions:
            self._evicted.append(h)
        self.num_evictions += 1
        return True

    def _drop(self, block_hash: BlockHash) -> None:
        e = self.entries.pop(block_hash)
        if e.children:  # a failed save's pending chain or a corrupt record: drop its descendants
            for child in [h for h, c in self.entries.items() if c.parent == block_hash]:
                self._drop(child)
        if e.parent in self.entries:
            self.entries[e.parent].children -= 1
        self._free.append(e.slot)

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return len(self.entries)

    @property
    def num_held(self) -> int:
        """Slots held outside the index (:meth:`acquire`)."""
        return len(self._held)

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins)

    def check_invariants(self) -> None:
        assert len(self._free) + len(self.entries) + len(self._held) == self.capacity, "tier slots lost or doubled"
        slots = [e.slot for e in self.entries.values()] + self._free.slots() + sorted(self._held)
        assert sorted(slots) == list(range(self.capacity)), "tier slot map broken"
        for h, e in self.entries.items():
            assert e.parent == ROOT_HASH or e.parent in self.entries, "tier chain not prefix-closed"
            kids = sum(1 for c in self.entries.values() if c.parent == h)
            assert e.children == kids, f"child count {e.children} != {kids}"
            assert e.pins >= 0 and (e.ready or not e.pins), "a pending entry is pinned"
