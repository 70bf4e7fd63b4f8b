"""Which KV cache groups a model's layers get on an engine (:mod:`pagedkv.kv.groups`):
decided from the engine config and the model's layer windows, torch-free, shared by the
engine and the simulator (the planner applies the same whole-table rule:
:func:`pagedkv.kv.groups.reads_whole_tables`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.config.engine import SCORED_EVICTIONS, EngineConfig
from pagedkv.kv.groups import (
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    group_layers,
    hybrid_page_layers,
    reads_whole_tables,
    shared_page_slots,
    single_group,
)

if TYPE_CHECKING:
    from pagedkv.model.config import ModelConfig


def kv_groups(config: EngineConfig, cfg: ModelConfig, has_draft: bool) -> tuple[KVCacheGroup, ...]:
    """One group of every layer: a sliding-window group (pages before the window go back,
    :class:`~pagedkv.kv.single_type.SlidingWindowManager`) when every layer has the same
    window (or streaming eviction gives them one, with sinks) and nothing else reads those
    pages; window groups beside full-attention groups, all of equally many layers, when the
    model mixes one window with full layers (Gemma 2's halves; Gemma 3's 5:1 in groups of
    :func:`~pagedkv.kv.groups.hybrid_page_layers` layers; their pages share tensors:
    :func:`~pagedkv.kv.groups.shared_page_slots`); else full attention (correct for any model:
    attention itself applies each layer's window). Not yet for: a draft model (its layers
    attend to everything on the same tables), CPU/disk tiers and swap preemption (they copy
    whole tables), the contiguous allocator, or several windows."""
    windows, sinks = set(cfg.layer_windows), 0
    if config.kv_eviction in SCORED_EVICTIONS:
        if any(w is not None for w in windows):
            raise ValueError(f"kv_eviction {config.kv_eviction} needs a model with full attention in every layer "
                             "(this one has sliding-window layers)")
        return single_group(cfg.num_hidden_layers, config.block_size)
    if config.kv_eviction == "streaming":
        windows, sinks = {config.kv_window_tokens}, config.num_sink_tokens
    plain = not reads_whole_tables(has_draft, config.kv_offload_memory is not None,  # (swap needs the tier)
                                   config.kv_allocator == "contiguous")
    if len(windows) == 1 and None not in windows and plain:
        spec = SlidingWindowSpec(config.block_size, sliding_window=windows.pop(), num_sinks=sinks)
        return group_layers([spec] * cfg.num_hidden_layers)
    if plain and len(windows) == 2 and None in windows:  # window and full layers (Gemma 2, Gemma 3)
        full = FullAttentionSpec(config.block_size)
        groups = group_layers([full if w is None else SlidingWindowSpec(config.block_size, sliding_window=w)
                               for w in cfg.layer_windows], hybrid_page_layers(cfg.layer_windows))
        if shared_page_slots(groups) is not None:  # equal group sizes: pages shared (kv/groups.py)
            return groups
    return single_group(cfg.num_hidden_layers, config.block_size, config.kv_allocator == "contiguous")
