"""The CPU kernel library's ops, or their torch composites where it is not used.

``PAGEDKV_ATTENTION`` (read at each call) picks, for every op of the library (paged
attention, the one-call decoder layer, RMSNorm, SwiGLU, RoPE, page copies):

- unset or ``auto``: the library; if it cannot be built here (no C++ compiler, no ninja) one
  warning is issued and the torch composites are used for the rest of the process;
- ``kernel``: the library or an error (``KernelBuildError``, ``ValueError``);
- ``reference``: always torch; nothing is compiled.
- ``triton``: attention through the Triton kernel (:mod:`pagedkv.kernels.triton`), on the CPU
  under ``TRITON_INTERPRET=1`` too, and torch for the rest: what a GPU runs, testable here.

The library itself is built and loaded by :mod:`pagedkv.kernels.cpu.library`; attention
chooses between it and the reference in :mod:`pagedkv.attention.dispatch`.
"""

from __future__ import annotations

import os
import warnings

import torch

from pagedkv.kernels.cpu import library as _library
from pagedkv.kernels.cpu.library import KernelBuildError, load_kernel

MODES = ("auto", "kernel", "reference", "triton")
_warned: list[str] = []
_modes: dict[str | None, str] = {}
_ops: dict[tuple, tuple] = {}  # (PAGEDKV_ATTENTION, name) -> (the kernel state it came from, op or None)


def attention_mode() -> str:
    """The ``PAGEDKV_ATTENTION`` setting, validated.

    Raises:
        ValueError: for a value other than auto, kernel or reference.
    """
    raw = os.environ.get("PAGEDKV_ATTENTION")
    mode = _modes.get(raw)
    if mode is None:  # parsed once per value: this runs several times per layer and step
        mode = (raw or "auto").strip().lower() or "auto"
        if mode not in MODES:
            raise ValueError(f"PAGEDKV_ATTENTION={mode!r}: expected one of {', '.join(MODES)}")
        _modes[raw] = mode
    return mode


def kernel_state() -> dict:
    """The kernel loader's state (a resolved op is reused only while it is the same one)."""
    return _library._state


def prepare_kernel() -> bool:
    """Build or load the kernel now, if ``PAGEDKV_ATTENTION`` wants it (a server does this
    before it accepts requests, so no request waits for a compile inside an engine step).
    Returns whether the kernel will be used; raises as :func:`paged_attention` would.

    Raises:
        ValueError: bad ``PAGEDKV_ATTENTION``.
        KernelBuildError: ``kernel`` forced where it cannot be built.
    """
    mode = attention_mode()
    return mode not in ("reference", "triton") and library_or_none(mode) is not None


def library_or_none(mode: str):
    try:
        return load_kernel()
    except KernelBuildError as e:
        if mode == "kernel":
            raise
        if not _warned:
            _warned.append(str(e))
            warnings.warn(f"pagedkv: the fused CPU paged-attention kernel is unavailable ({e}); "
                          "using the pure-torch reference (set PAGEDKV_ATTENTION=reference to "
                          "skip the build; batch-invariant mode then covers the linear layers only)",
                          RuntimeWarning, stacklevel=3)
        return None


def layer_op(name: str):
    """``torch.ops.pagedkv.<name>`` (``rms_norm``, ``silu_and_mul``, ``rope_rotate_``: see
    ``csrc/layer_ops.cpp``) where ``PAGEDKV_ATTENTION`` uses the kernel library and it
    loads, else None: the caller then runs the torch composite."""
    key = (os.environ.get("PAGEDKV_ATTENTION"), name)
    hit = _ops.get(key)
    if hit is not None and hit[0] is kernel_state():  # resolved before, with this kernel state
        return hit[1]
    mode = attention_mode()
    op = None if mode in ("reference", "triton") or library_or_none(mode) is None else getattr(torch.ops.pagedkv, name)
    _ops[key] = (kernel_state(), op)
    return op


def copy_pages(dst: list[torch.Tensor], dst_pages: torch.Tensor, src: list[torch.Tensor],
               src_pages: torch.Tensor, parallel: bool = False) -> None:
    """``dst[j][dst_pages] = src[j][src_pages]`` for every j, as bytes (KV pages between
    pools, e.g. the CPU tier): the kernel library's ``copy_blocks``, one memcpy per page,
    else torch's gather and scatter (:func:`torch_copy_pages`).
    ``parallel``: use torch's threads at any size (a copy on the thread that runs the model,
    between forwards); else only for copies of 8 MiB or more (a save beside a forward)."""
    on_cpu = all(t.is_cpu for t in dst + src)
    op = layer_op("copy_blocks") if on_cpu else None
    if op is not None and all(t.is_contiguous() for t in dst + src):
        op(dst, src, dst_pages, src_pages, parallel)
    else:
        torch_copy_pages(dst, dst_pages, src, src_pages)


def torch_copy_pages(dst: list[torch.Tensor], dst_pages: torch.Tensor, src: list[torch.Tensor],
                     src_pages: torch.Tensor, parallel: bool = False) -> None:
    """``dst[j][dst_pages] = src[j][src_pages]`` for every j, as bytes, by torch's gather and
    scatter (the composite of :func:`copy_pages`; ``parallel`` is not used)."""
    for d, s in zip(dst, src):
        if d.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # index_copy_ has no fp8 kernel
            d, s = d.view(torch.uint8), s.view(torch.uint8)
        d.index_copy_(0, dst_pages, s.index_select(0, src_pages))
