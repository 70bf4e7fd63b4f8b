"""Slot mapping: where a token's KV lives in the paged cache, the one formula every room uses.

Slot ``s`` of the cache is block ``s // block_size``, offset ``s % block_size``; the token at
cache index ``i`` of a request whose block table is ``table`` lives in slot
``table[i // block_size] * block_size + i % block_size``. The KV manager, the model runner,
compaction (KV eviction) and the draft model all map through these functions. Plain ints,
no torch: the runner makes its ``[T]`` int64 tensor from the list.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def slot(table: Sequence[int], index: int, block_size: int) -> int:
    """The flat cache slot of cache index ``index`` of a request with block table ``table``."""
    return table[index // block_size] * block_size + index % block_size


def slot_mapping(table: Sequence[int], indices: Iterable[int], block_size: int) -> list[int]:
    """:func:`slot` of each of ``indices`` (e.g. ``range(start, end)`` for a step's new tokens)."""
    return [table[i // block_size] * block_size + i % block_size for i in indices]
