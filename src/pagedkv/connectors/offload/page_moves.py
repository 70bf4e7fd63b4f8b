"""How the device tier worker moves one tensor's pages between the cache and the host tier.

Two ways, one signature: ``move(dst, dst_pages, src, src_pages, to_host) -> held`` copies
``dst[dst_pages.ids[i]] = src[src_pages.ids[i]]`` on the current stream and returns the
temporaries that must live until the stream has run the copy. Each side is a :class:`Pages`:
the page numbers, and the same as an index tensor on the cache's device, uploaded once a
step from pinned memory (an upload from pageable memory may wait for the stream).

- :func:`kernel_move`: the Triton page-copy kernel (:mod:`pagedkv.kernels.triton.page_copy`),
  one launch whatever the slots' order: the GPU reads and writes the pinned tier directly.
  The default on a GPU.
- :func:`run_move`: torch ops: one gather or scatter of the pages on the cache's side
  (``index_select`` / ``index_copy_``) and one transfer per run of consecutive tier slots
  (:func:`slot_runs`). The default on the CPU (where everything is host memory), and the
  GPU's fallback if the kernel cannot address the tier.

``PAGEDKV_PAGE_COPY`` (read when a worker is made) picks one: ``auto`` (the default),
``kernel`` (on the CPU: the kernel interpreted, ``TRITON_INTERPRET=1``; the tests' way) or
``torch``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

PAGE_COPY_WAYS = ("auto", "kernel", "torch")


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(first slot, first index, length)`` of each run of consecutive ``slots`` in order:
    ``[4, 5, 6, 9, 2]`` -> ``[(4, 0, 3), (9, 3, 1), (2, 4, 1)]``."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][2] == s:
            first, at, n = runs[-1]
            runs[-1] = (first, at, n + 1)
        else:
            runs.append((s, i, 1))
    return runs


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as raw bytes with its page dimension first (fp8 has no index kernels everywhere)."""
    return t.view(torch.uint8)


class Pages(NamedTuple):
    """One side of a move: page (or slot) numbers, and the same as an int64 index tensor on
    the cache's device."""
    ids: list[int]
    index: torch.Tensor

    @classmethod
    def of(cls, ids: list[int], device: torch.device) -> "Pages":
        """Upload ``ids`` to ``device`` on the current stream (from pinned memory on a GPU)."""
        host = torch.tensor(ids, dtype=torch.int64, pin_memory=device.type == "cuda")
        return cls(ids, host.to(device, non_blocking=True))


def run_move(dst: torch.Tensor, dst_pages: Pages, src: torch.Tensor, src_pages: Pages,
             to_host: bool) -> list[torch.Tensor]:
    """Gather or scatter on the cache's side, a transfer per run of consecutive tier slots."""
    if to_host:  # src: the cache, dst: the tier
        staged = _bytes(src).index_select(0, src_pages.index)
        for first, at, n in slot_runs(dst_pages.ids):
            _bytes(dst)[first:first + n].copy_(staged[at:at + n], non_blocking=True)
        return [staged]
    raw = _bytes(src)
    staged = torch.empty((len(src_pages.ids), *raw.shape[1:]), dtype=torch.uint8, device=dst.device)
    for first, at, n in slot_runs(src_pages.ids):
        staged[at:at + n].copy_(raw[first:first + n], non_blocking=True)
    _bytes(dst).index_copy_(0, dst_pages.index, staged)
    return [staged]


def kernel_move(dst: torch.Tensor, dst_pages: Pages, src: torch.Tensor, src_pages: Pages,
                to_host: bool) -> list[torch.Tensor]:
    """One Triton launch on the cache's device (the tier addressed directly)."""
    from pagedkv.kernels.triton.page_copy import copy_pages

    copy_pages(dst, dst_pages.index, src, src_pages.index)
    return []


def choose_move(device: torch.device):
    """The move for a cache on ``device``, by ``PAGEDKV_PAGE_COPY`` (see the module docstring).

    Raises:
        ValueError: an unknown ``PAGEDKV_PAGE_COPY``.
    """
    way = os.environ.get("PAGEDKV_PAGE_COPY", "auto")
    if way not in PAGE_COPY_WAYS:
        raise ValueError(f"PAGEDKV_PAGE_COPY must be one of {PAGE_COPY_WAYS}, got {way!r}")
    if way == "kernel" or (way == "auto" and device.type == "cuda"):
        return kernel_move
    return run_move
