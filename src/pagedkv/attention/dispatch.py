"""paged_attention: the fused CPU kernel where it is available, else the pure-torch reference.

``PAGEDKV_ATTENTION`` (read at each call) picks the implementation:

- unset or ``auto``: the kernel; if it cannot be built here (no C++ compiler, no ninja) one
  warning is issued and the reference is used for the rest of the process. Inputs the kernel
  does not cover (see ``kernel_supports``, e.g. CUDA tensors) go to the reference silently.
- ``kernel``: the kernel or an error (``KernelBuildError``, ``ValueError``).
- ``reference``: always the reference; nothing is compiled.

Both give the same results within float rounding (tests/test_attention_kernel.py), and each
is deterministic per query row (see ``csrc/paged_attention_kernel.cpp``). Through a whole
model with quantized pages the two can drift further apart: a last-bit difference in one
layer can move a later key across an int8/fp8 rounding boundary (a break-it run measured
prompt logprobs up to 1e-2 apart with static per-channel int8 scales, 8e-5 per-token-head;
greedy tokens agreed).
"""

from __future__ import annotations

import os
import warnings

import torch

from pagedkv.attention import kernel as _kernel_module
from pagedkv.attention.kernel import KernelBuildError, kernel_supports, load_kernel
from pagedkv.attention.paged import AttentionMetadata, paged_attention_reference

MODES = ("auto", "kernel", "reference")
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
    return _kernel_module._state


def prepare_kernel() -> bool:
    """Build or load the kernel now, if ``PAGEDKV_ATTENTION`` wants it (a server does this
    before it accepts requests, so no request waits for a compile inside an engine step).
    Returns whether the kernel will be used; raises as :func:`paged_attention` would.

    Raises:
        ValueError: bad ``PAGEDKV_ATTENTION``.
        KernelBuildError: ``kernel`` forced where it cannot be built.
    """
    mode = attention_mode()
    return mode != "reference" and _kernel_or_none(mode) is not None


def _kernel_or_none(mode: str):
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
    op = None if mode == "reference" or _kernel_or_none(mode) is None else getattr(torch.ops.pagedkv, name)
    _ops[key] = (kernel_state(), op)
    return op


def copy_pages(dst: list[torch.Tensor], dst_pages: torch.Tensor, src: list[torch.Tensor],
               src_pages: torch.Tensor, parallel: bool = False) -> None:
    """``dst[j][dst_pages] = src[j][src_pages]`` for every j, as bytes (KV pages between
    pools, e.g. the CPU tier): the kernel library's ``copy_blocks``, one memcpy per page,
    else torch's gather and scatter (:func:`pagedkv.kv.cpu_offload_worker.torch_copy_pages`).
    ``parallel``: use torch's threads at any size (a copy on the thread that runs the model,
    between forwards); else only for copies of 8 MiB or more (a save beside a forward)."""
    from pagedkv.kv.cpu_offload_worker import torch_copy_pages

    op = layer_op("copy_blocks")
    if op is not None and all(t.is_contiguous() for t in dst + src):
        op(dst, src, dst_pages, src_pages, parallel)
    else:
        torch_copy_pages(dst, dst_pages, src, src_pages)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, window: int = 0, sinks: int = 0,
                    sink_q: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal GQA attention of a step's queries over paged KV; ``window`` W > 0 (a sliding
    window layer's, in tokens) limits the query at position p to keys ``p - W + 1 .. p``
    plus, with ``sinks`` S, keys ``0 .. S - 1``, scored with ``sink_q`` (``[T, H, D]``,
    each row's query rotated to its position within the cache) where it is given;
    ``softcap`` > 0 caps each scaled score s as ``softcap * tanh(s / softcap)`` (Gemma 2).

    ``q`` ``[T, num_heads, head_dim]`` fp32; ``k_cache``/``v_cache``
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (fp32/fp16/bf16); returns
    ``[T, num_heads, head_dim]`` fp32. Full contract: :mod:`pagedkv.attention.paged`.
    Quantized pages (int8/fp8) come with ``k_scale``/``v_scale`` (fp32, ``[num_blocks,
    block_size, num_kv_heads]``, ``[num_kv_heads]`` or ``[1]``); the kernel dequantizes each
    page as it reads it, the reference dequantizes a gathered copy.

    Raises:
        ValueError: bad ``PAGEDKV_ATTENTION``, or ``kernel`` forced on inputs it does not cover.
        KernelBuildError: ``kernel`` forced where it cannot be built.
    """
    mode = attention_mode()
    if mode == "reference":
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q,
                                         softcap)
    if not kernel_supports(q, k_cache, v_cache, k_scale):
        if mode == "kernel":
            raise ValueError(f"the attention kernel does not cover q {tuple(q.shape)} {q.dtype} {q.device}"
                             f" with a cache {tuple(k_cache.shape)} {k_cache.dtype}")
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q,
                                         softcap)
    op = _kernel_or_none(mode)
    if op is None:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q,
                                         softcap)
    seq_info, tables = meta.packed
    sq = None if sink_q is None or not sinks else sink_q.contiguous()
    return op(q.contiguous(), k_cache, v_cache, seq_info, tables, scale, -1, k_scale, v_scale, window, sinks, sq,
              softcap)
