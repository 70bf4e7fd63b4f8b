"""Attention metadata: what one engine step's tokens write and read in the paged KV cache.

Shape contract (one step, ``T`` new tokens from ``S`` sequences, flattened): ``slot_mapping``
``[T]`` int64 is the flat cache slot each new token writes (slot ``s`` is block ``s // block_size``,
offset ``s % block_size``: :func:`pagedkv.kv.slots.slot_mapping`); sequence ``i`` has query rows
``query_start .. query_start + query_len`` and reads ``context_len`` tokens of KV through its
block table (``[ceil(context_len / block_size)]`` int64), the last ``query_len`` of them its new
ones. The reference (:mod:`pagedkv.attention.reference`) and every kernel read this.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class SeqAttention:
    """One sequence's slice of a step."""
    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass(frozen=True)
class KernelArgs:
    """A step's sequences already laid out on the device for the Triton kernel, so a launch
    needs nothing from the host (CUDA graphs: :mod:`pagedkv.worker.cuda_graphs`). Shapes are
    fixed for a batch-size bucket; padding sequences have ``query_len`` 0.

    Attributes:
        seq_info: ``[S, 5]`` int64, as :attr:`AttentionMetadata.packed`'s.
        tables: ``[S * max_pages]`` int64, sequence ``i``'s table at ``i * max_pages``.
        tile_seq, tile_first: ``[S]`` int64: one program per sequence, from its first row.
        max_pages: pages a sequence may read at most.
        num_splits: flash-decoding splits (a power of two).
    """
    seq_info: torch.Tensor
    tables: torch.Tensor
    tile_seq: torch.Tensor
    tile_first: torch.Tensor
    max_pages: int
    num_splits: int = 1


@dataclass
class AttentionMetadata:
    """Where a step's tokens write (``slot_mapping`` ``[T]`` int64) and what each sequence
    reads; ``kernel_args``: the same laid out on the device (decode steps under CUDA graphs)."""
    slot_mapping: torch.Tensor
    seqs: list[SeqAttention]
    kernel_args: KernelArgs | None = None

    @cached_property
    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences as two flat tensors for kernels, built once per step: ``seq_info``
        ``[S, 5]`` int64 (query_start, query_len, context_len, table_offset, table_len) and
        every block table concatenated, ``[sum table_len]`` int64."""
        rows, offset = [], 0
        for s in self.seqs:
            n = s.block_table.numel()
            rows.append((s.query_start, s.query_len, s.context_len, offset, n))
            offset += n
        tables = [s.block_table.to(torch.int64) for s in self.seqs]
        return (torch.tensor(rows, dtype=torch.int64).view(-1, 5),
                torch.cat(tables) if tables else torch.zeros(0, dtype=torch.int64))
