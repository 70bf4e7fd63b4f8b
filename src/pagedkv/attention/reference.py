"""Paged attention: the pure-torch reference.

Shape contract (one engine step, ``T`` new tokens from ``S`` sequences, flattened)::

    q            [T, num_heads, head_dim]          fp32
    k_cache      [num_blocks, block_size, num_kv_heads, head_dim]   storage dtype
    v_cache      [num_blocks, block_size, num_kv_heads, head_dim]
    seq i        query rows q[query_start : query_start + query_len]
                 context_len tokens of KV, the last query_len of which are the new ones
                 block_table [ceil(context_len / block_size)] int64
    out          [T, num_heads, head_dim]          fp32

Query row ``r`` of sequence ``i`` sits at position ``context_len - query_len + r`` and
sees keys ``0..that position`` (causal). Grouped-query attention: query head ``h`` reads
KV head ``h // (num_heads // num_kv_heads)``. Every K/V, new ones included, is read back
from the pages, so the storage dtype rounds a token's KV the same way in prefill and decode.
"""

from __future__ import annotations

import torch

from pagedkv.attention.metadata import AttentionMetadata


def _check_scale(cache: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError unless ``scale`` has one of the layouts the kernel also accepts."""
    nb, bs, hkv, d = cache.shape
    ok = (tuple(scale.shape) in ((nb, bs, hkv), (hkv,), (1,))
          or (tuple(scale.shape) == (hkv, d) and scale.dtype == torch.float32))
    if not ok or scale.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"scale {tuple(scale.shape)} {scale.dtype} is none of [num_blocks, block_size, kv_heads], "
                         f"[kv_heads, head_dim] (float32), [kv_heads], [1] (float32 or bfloat16)")


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous ``[length, num_kv_heads, head_dim]`` fp32 copy of a sequence's first ``length``
    tokens; quantized pages are multiplied by their ``scale`` (``[num_blocks, block_size,
    kv_heads]`` per token and head, ``[kv_heads, head_dim]`` per channel, ``[kv_heads]`` per
    head, or ``[1]``)."""
    block_table = block_table.to(cache.device)  # (tables are built on the host)
    if cache.element_size() == 1:  # int8/fp8: index_select has no fp8 kernel on CPU; move bytes
        pages = cache.view(torch.uint8).index_select(0, block_table).view(cache.dtype)
    else:
        pages = cache.index_select(0, block_table)       # [nb, block_size, kv_heads, head_dim]
    out = pages.flatten(0, 1)[:length].float()            # [length, kv_heads, head_dim]
    if scale is None:
        return out
    _check_scale(cache, scale)
    if scale.dim() == 3:
        return out * scale.index_select(0, block_table).flatten(0, 1)[:length].unsqueeze(-1).float()
    if scale.dim() == 2:                                  # per channel: [kv_heads, head_dim]
        return out * scale.float().unsqueeze(0)
    return out * scale.float().view(1, -1, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
           sinks: int = 0, sink_q: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal GQA attention of the last ``n`` positions of a length-``L`` context; with
    ``window`` W > 0, the row at position p sees keys ``p - W + 1 .. p`` only, and keys
    ``0 .. sinks - 1`` (StreamingLLM's attention sinks); a sink before a row's window is
    scored with ``sink_q``'s row where it is given (``[n, H, D]``: queries rotated to their
    position within the cache). ``softcap`` > 0: each scaled score s becomes
    ``softcap * tanh(s / softcap)`` before masking (Gemma 2's attention logit soft-capping).

    ``q`` ``[n, H, D]``, ``k``/``v`` ``[L, Hkv, D]`` with ``n <= L``; returns ``[n, H, D]``.
    """
    n, num_heads, dim = q.shape
    length, kv_heads, _ = k.shape
    group = num_heads // kv_heads

    def by_kv_head(x: torch.Tensor) -> torch.Tensor:  # [n, H, D] -> [Hkv, G*n, D]
        return x.reshape(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)

    scores = torch.bmm(by_kv_head(q), k.permute(1, 2, 0)) * scale    # [Hkv, G*n, L]
    if sink_q is not None and sinks and window:  # sinks before a row's window: scored by its sink query
        s = min(sinks, length)
        rows = torch.arange(length - n, length, device=q.device).unsqueeze(1)
        before = (torch.arange(s, device=q.device).unsqueeze(0) <= rows - window).repeat(group, 1)  # [G*n, s]
        sink_scores = torch.bmm(by_kv_head(sink_q), k[:s].permute(1, 2, 0)) * scale
        scores[..., :s] = torch.where(before, sink_scores, scores[..., :s])
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if n > 1 or (window and length > window):
        rows = torch.arange(length - n, length, device=q.device).unsqueeze(1)  # position of each query row
        hidden = torch.arange(length, device=q.device).unsqueeze(0) > rows     # [n, L]: the future
        if window:
            col = torch.arange(length, device=q.device).unsqueeze(0)
            hidden |= (col <= rows - window) & (col >= sinks)  # before the window, not a sink
        scores = scores.view(kv_heads, group, n, length).masked_fill(hidden, float("-inf"))
        scores = scores.view(kv_heads, group * n, length)
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, v.permute(1, 0, 2))            # [Hkv, G*n, D]
    return out.view(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None, window: int = 0, sinks: int = 0,
                              sink_q: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Attention over paged KV, one sequence at a time (see the module's shape contract);
    quantized pages are dequantized with ``k_scale``/``v_scale`` as they are read; ``window``:
    the sliding window in tokens (0: none), ``sinks``: leading positions every row sees too
    (scored with ``sink_q`` ``[T, H, D]`` where given), ``softcap``: as :func:`attend`."""
    out = torch.empty_like(q)
    for s in meta.seqs:
        rows = slice(s.query_start, s.query_start + s.query_len)
        k = gather_pages(k_cache, s.block_table, s.context_len, k_scale)
        v = gather_pages(v_cache, s.block_table, s.context_len, v_scale)
        out[rows] = attend(q[rows].float(), k, v, scale, window, sinks,  # (fp32 products, any q dtype)
                           None if sink_q is None else sink_q[rows].float(), softcap).to(out.dtype)
    return out
