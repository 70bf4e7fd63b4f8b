"""paged_attention: the fused CPU kernel where it is available, the Triton kernel on a GPU,
else the pure-torch reference.

Queries on a GPU always go to the Triton kernel (:mod:`pagedkv.kernels.triton.paged_attention`;
the reference where it does not take the inputs). On the CPU, ``PAGEDKV_ATTENTION`` (read at
each call) picks the implementation:

- unset or ``auto``: the kernel; if it cannot be built here (no C++ compiler, no ninja) one
  warning is issued and the reference is used for the rest of the process. Inputs the kernel
  does not cover (see ``kernel_supports``, e.g. CUDA tensors) go to the reference silently.
- ``kernel``: the kernel or an error (``KernelBuildError``, ``ValueError``).
- ``reference``: always the reference; nothing is compiled.
- ``triton``: the Triton kernel, interpreted on the CPU (``TRITON_INTERPRET=1`` must be set
  before it is first imported): the GPU's path, for tests; slow.

Both give the same results within float rounding (tests/test_attention_kernel.py), and each
is deterministic per query row (see ``csrc/paged_attention_kernel.cpp``). Through a whole
model with quantized pages the two can drift further apart: a last-bit difference in one
layer can move a later key across an int8/fp8 rounding boundary (a break-it run measured
prompt logprobs up to 1e-2 apart with static per-channel int8 scales, 8e-5 per-token-head;
greedy tokens agreed).
"""

from __future__ import annotations

import torch

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.reference import paged_attention_reference
from pagedkv.kernels.cpu.library import kernel_supports
from pagedkv.kernels.cpu.ops import attention_mode, library_or_none


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
    ``[T, num_heads, head_dim]`` fp32. Full contract: :mod:`pagedkv.attention.reference`.
    Quantized pages (int8/fp8) come with ``k_scale``/``v_scale`` (fp32, ``[num_blocks,
    block_size, num_kv_heads]``, ``[num_kv_heads]`` or ``[1]``); the kernel dequantizes each
    page as it reads it, the reference dequantizes a gathered copy.

    Raises:
        ValueError: bad ``PAGEDKV_ATTENTION``, or ``kernel`` forced on inputs it does not cover.
        KernelBuildError: ``kernel`` forced where it cannot be built.
    """
    mode = attention_mode()
    if q.is_cuda or mode == "triton" or meta.kernel_args is not None:
        return _triton(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q, softcap)
    if mode == "reference":
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q,
                                         softcap)
    if not kernel_supports(q, k_cache, v_cache, k_scale):
        if mode == "kernel":
            raise ValueError(f"the attention kernel does not cover q {tuple(q.shape)} {q.dtype} {q.device}"
                             f" with a cache {tuple(k_cache.shape)} {k_cache.dtype}")
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q,
                                         softcap)
    op = library_or_none(mode)
    if op is None:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q,
                                         softcap)
    seq_info, tables = meta.packed
    sq = None if sink_q is None or not sinks else sink_q.contiguous()
    return op(q.contiguous(), k_cache, v_cache, seq_info, tables, scale, -1, k_scale, v_scale, window, sinks, sq,
              softcap)


def _triton(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q, softcap) -> torch.Tensor:
    from pagedkv.kernels.triton.paged_attention import paged_attention_triton, supports

    if not supports(q, k_cache, v_cache):
        return paged_attention_reference(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q,
                                         softcap)
    return paged_attention_triton(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window, sinks, sink_q, softcap)
