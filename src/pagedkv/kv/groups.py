"""KV cache groups: layers that keep the same tokens share one block table per request.

A model's layers are grouped by a frozen per-layer spec. Full-attention layers keep every
token; a sliding-window layer keeps only its last ``W`` tokens, so its table can hand
pages back early (the freed entries point at the null block). Each group gets its own
block tables from a manager class chosen by the spec's type
(:data:`pagedkv.kv.single_type.SPEC_MANAGER_MAP`), and all groups draw pages from one
:class:`~pagedkv.kv.block_pool.BlockPool`::

    layers   0  1  2  3  4  5          groups   0: full   (layers 0, 2, 4)
    window   -  W  -  W  -  W                   1: W-slid (layers 1, 3, 5)
    request r:  group 0 table [7, 3, 9]   group 1 table [0(null), 4, 8]

A page is one block of ``block_size`` tokens for every layer of its group (the storage
allocates page tensors per layer; a page id is valid in every layer of the group that
holds it). When the groups have equally many layers (Gemma 2's alternation), the storage
lets them share page tensors (:func:`shared_page_slots`: a group's i-th layer uses slot i),
so a page holds one group's layers and a window group's pages cost only its own layers
(vLLM's hybrid allocator does the same). Unequal mixes (Gemma 3: five window layers to one
full) are cut into groups of equally many layers, the greatest common divisor of the two
counts (:func:`hybrid_page_layers`), several groups then sharing one spec::

    Gemma 3 1B: 22 window + 4 full layers -> 11 window groups and 2 full groups of 2 layers

Plain data only: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Sequence


@dataclass(frozen=True)
class FullAttentionSpec:
    """Layers that attend to every previous token: a request holds
    ``ceil(num_tokens / block_size)`` pages, taken as it grows."""
    block_size: int

    def __post_init__(self) -> None:
        if int(self.block_size) <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")


@dataclass(frozen=True)
class ContiguousAttentionSpec(FullAttentionSpec):
    """Full attention under the pre-paging allocator (FasterTransformer, Orca): a request
    reserves pages for ``prompt + max_tokens`` tokens at admission. The benchmarks'
    baseline; unused output slots are wasted by design."""


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Layers that attend to the last ``sliding_window`` tokens (Mistral, Gemma-2/3,
    Qwen2's window layers), and with ``num_sinks`` S also to the first S positions
    (StreamingLLM); :class:`~pagedkv.kv.single_type.SlidingWindowManager` gives back their
    pages between the sinks and the window."""
    sliding_window: int = 0
    num_sinks: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if int(self.sliding_window) <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")


KVLayerSpec = FullAttentionSpec  # the base of every per-layer spec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers ``layer_ids`` (model order) that share block tables under ``spec``."""
    spec: KVLayerSpec
    layer_ids: tuple[int, ...]


def group_layers(layer_specs: Sequence[KVLayerSpec], group_size: int = 0) -> tuple[KVCacheGroup, ...]:
    """Group layers with equal specs, in order of each group's first layer; with
    ``group_size``, each spec's layers (model order) in runs of that many.

    ``layer_specs[i]`` is layer ``i``'s spec. Raises ValueError if there are no layers, the
    block sizes differ (one pool has one page size) or ``group_size`` does not divide a
    spec's layer count.
    """
    if not layer_specs:
        raise ValueError("a KV cache needs at least one layer")
    if len({s.block_size for s in layer_specs}) != 1:
        raise ValueError(f"all KV groups must share one block size, got {sorted({s.block_size for s in layer_specs})}")
    order: dict[KVLayerSpec, list[int]] = {}
    for i, spec in enumerate(layer_specs):
        order.setdefault(spec, []).append(i)
    if not group_size:
        return tuple(KVCacheGroup(spec, tuple(ids)) for spec, ids in order.items())
    if any(len(ids) % group_size for ids in order.values()):
        raise ValueError(f"group size {group_size} does not divide the layer counts "
                         f"{sorted(len(ids) for ids in order.values())}")
    runs = [KVCacheGroup(spec, tuple(ids[j:j + group_size])) for spec, ids in order.items()
            for j in range(0, len(ids), group_size)]
    return tuple(sorted(runs, key=lambda g: g.layer_ids[0]))


def single_group(num_layers: int, block_size: int, contiguous: bool = False) -> tuple[KVCacheGroup, ...]:
    """Every layer in one full-attention group (``contiguous``: the baseline allocator)."""
    spec = (ContiguousAttentionSpec if contiguous else FullAttentionSpec)(block_size)
    return group_layers([spec] * num_layers)


def shared_page_slots(groups: Sequence[KVCacheGroup]) -> tuple[int, ...] | None:
    """Per layer (model order), the page slot it uses when several groups of equally many
    layers share page tensors: layer ``group.layer_ids[i]`` uses slot ``i``. None for one
    group or groups of different sizes (every layer then has its own tensors)."""
    if len(groups) < 2 or len({len(g.layer_ids) for g in groups}) != 1:
        return None
    slots: dict[int, int] = {}
    for g in groups:
        slots.update({layer: i for i, layer in enumerate(g.layer_ids)})
    return tuple(slots[layer] for layer in range(len(slots)))


def reads_whole_tables(draft_model: bool, offload_tier: bool, contiguous: bool = False) -> bool:
    """Whether some part of the engine reads every layer of a request's pages through one
    block table, so every layer must be in one full-attention group (window layers then keep
    their pages): a draft model (its layers attend over the target's tables), a CPU/disk KV
    tier or swap (they copy whole tables), or the contiguous allocator. The engine
    (:func:`pagedkv.core.kv_layout.kv_groups`) and the planner both decide by this."""
    return draft_model or offload_tier or contiguous


def windows_free_pages(layer_windows: Sequence[int | None]) -> bool:
    """Whether the engine keeps window KV groups for these layers, so window layers give
    pages back: one window on every layer, or one window beside full layers (else one
    full-attention group holds every page; a draft model and the offload tiers force that
    too)."""
    return len(set(layer_windows) - {None}) == 1


def hybrid_page_layers(layer_windows: Sequence[int | None]) -> int:
    """Layers per page of the hybrid layout (:func:`shared_page_slots`) for a model whose
    layers mix one sliding window with full attention: the greatest common divisor of the
    two layer counts (Gemma 2's alternation: half the layers; Gemma 3 1B's 22 window and 4
    full layers: 2), each group that many layers; else 0 (every page holds every layer). The
    planner, the simulator and the engine size their pools from this."""
    windows = set(layer_windows)
    if len(windows) != 2 or None not in windows:
        return 0
    full = sum(w is None for w in layer_windows)
    return gcd(full, len(layer_windows) - full)
