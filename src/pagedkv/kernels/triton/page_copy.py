"""Page copies between two KV pools in one Triton launch: ``dst[dst_pages[i]] = src[src_pages[i]]``.

The CPU tier's copies beside a GPU cache (:mod:`pagedkv.connectors.offload.device_tier_worker`):
one side is the device pool, the other the tier in pinned host memory, which the GPU reads
and writes directly over PCIe (unified virtual addressing: a pinned allocation's address is
valid on the device, and Triton's launcher accepts it). So a layer's pages move in one
launch whatever their order in the tier, where ``cudaMemcpyAsync`` would need one call per
run of consecutive slots (in a fragmented tier, one per page, each paying its own overhead).

Shapes: ``src`` ``[pages_src, *page]`` and ``dst`` ``[pages_dst, *page]``, the same page
shape and dtype, each contiguous; ``src_pages`` / ``dst_pages`` ``[n]`` int64 on the device
that runs the kernel. Pages move as raw 32-bit words where their bytes allow it, else bytes
(any dtype: fp8 and int8 pages, bf16 scales). Program ``(i, c)`` copies chunk ``c`` of pair
``i``; offsets are 64-bit (a tier may hold more than 2^31 words).

Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors: that is how CI tests it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # words a program copies


@triton.jit
def _copy_pages_kernel(src, dst, src_pages, dst_pages, page_words, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(src_pages + i).to(tl.int64)
    d = tl.load(dst_pages + i).to(tl.int64)
    offs = c.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < page_words
    words = tl.load(src + s * page_words + offs, mask=ok)
    tl.store(dst + d * page_words + offs, words, mask=ok)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[pages, words]``: int32 words where a page's bytes divide by 4, else bytes."""
    raw = t.reshape(t.shape[0], -1).view(torch.uint8)
    return raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw


def copy_pages(dst: torch.Tensor, dst_pages: torch.Tensor, src: torch.Tensor, src_pages: torch.Tensor) -> None:
    """``dst[dst_pages] = src[src_pages]`` as bytes, one launch (see the module docstring).

    Raises:
        ValueError: page shapes or dtypes differ, a pool is not contiguous, or the index
            tensors differ in length.
    """
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"page copy between pages of {tuple(src.shape[1:])} {src.dtype} and "
                         f"{tuple(dst.shape[1:])} {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("page copy needs contiguous pools")
    if src_pages.numel() != dst_pages.numel():
        raise ValueError(f"page copy of {src_pages.numel()} pages into {dst_pages.numel()}")
    n = src_pages.numel()
    if n == 0:
        return
    s, d = _words(src), _words(dst)
    words = s.shape[1]
    _copy_pages_kernel[(n, triton.cdiv(words, CHUNK))](s, d, src_pages, dst_pages, words, CHUNK=CHUNK)
