"""Paged attention in Triton: one kernel for a step's mixed batch (prefill chunks and decodes).

Shape contract (as :mod:`pagedkv.attention.reference`, which every case is tested against)::

    q, sink_q    [T, H, D]                              any float dtype (computed in fp32)
    k/v_cache    [num_blocks, block_size, Hkv, D]       fp32 / fp16 / bf16 / int8 / fp8 e4m3, e5m2
    k/v_scale    [num_blocks, block_size, Hkv]          per token and head (fp32 or bf16)
                 [Hkv, D]                               per channel (fp32)
                 [Hkv] | [1]                            per head | per tensor
    seq_info     [S, 5] int64: query_start, query_len, context_len, table_offset, table_len
    tables       [sum table_len] int64: every sequence's block table
    out          [T, H, D]                              q's dtype

One program takes ``BLOCK_Q`` query tokens of one sequence and one KV head, i.e.
``BLOCK_Q * G`` rows (G = H / Hkv query heads read that KV head: GQA/MQA), and streams the
sequence's pages through its block table with an online softmax (flash attention): a page is
read once for every query head of its group. Row ``r`` of a sequence sits at position
``context_len - query_len + r`` and sees keys ``0 .. position`` (causal within the chunk,
over cached pages for prefix hits and earlier chunks); a window W keeps keys
``position - W + 1 .. position`` plus the first ``sinks`` keys, scored by ``sink_q`` where
given; ``softcap`` > 0 caps each scaled score as ``softcap * tanh(s / softcap)`` (Gemma 2).
Pages before a window (not holding sinks) are never read. Quantized pages are dequantized
in registers as they are read (int8 ``* scale``; fp8 decoded from its bits, so the same
code runs under the interpreter and on any GPU); products use ``input_precision="ieee"``
fp32 when ``exact`` (the default for fp32 queries; a GPU's default would be TF32), else fp16
tensor-core products with fp32 accumulation.

For long contexts at small batch, :func:`paged_attention_triton` splits each sequence's pages
over ``num_splits`` programs (flash-decoding, Dao et al. 2023): each writes its partial
maximum, sum and output, and a second kernel combines them.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU
tensors: that is how CI tests them. The interpreter does not catch out-of-bounds reads, so
the tests use cases that would read garbage without each mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # (read through its attributes: the attention room sits above the kernels)
    from pagedkv.attention.metadata import AttentionMetadata

#: KV page kinds (``KV_KIND``) and scale kinds (``*_SCALE_KIND``)
FLOAT, INT8, FP8_E4M3, FP8_E5M2 = 0, 1, 2, 3
NO_SCALE, PER_TOKEN_HEAD, PER_HEAD, PER_TENSOR, PER_CHANNEL = 0, 1, 2, 3, 4
KV_KINDS = {torch.float32: FLOAT, torch.float16: FLOAT, torch.bfloat16: FLOAT, torch.int8: INT8,
            torch.float8_e4m3fn: FP8_E4M3, torch.float8_e5m2: FP8_E5M2}


@triton.jit
def _fp8_to_f32(bits, E5M2: tl.constexpr):
    """An fp8 value's fp32 from its byte (OCP OFP8: e4m3fn or e5m2; the pages never hold
    NaN or inf: quantization clamps to the format's maximum)."""
    b = bits.to(tl.int32) & 0xFF
    if E5M2:
        e = (b >> 2) & 0x1F
        m = (b & 0x3).to(tl.float32)
        mag = tl.where(e == 0, m * 0.25 * 6.103515625e-05, (1.0 + m * 0.25) * tl.exp2((e - 15).to(tl.float32)))
    else:
        e = (b >> 3) & 0xF
        m = (b & 0x7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.125 * 0.015625, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _load_page(ptr, scale_ptr, blk, kvh, offs_t, t_ok, offs_d, d_ok, stride_b, stride_t, stride_h,
               stride_sb, stride_st, stride_sh, HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr,
               SCALE_KIND: tl.constexpr):
    """One page's ``[block_size, D_PAD]`` keys or values of KV head ``kvh`` in fp32; slots
    past the context (``t_ok`` false: never written, whatever bits they hold, NaN included)
    read as 0, scales too."""
    x = tl.load(ptr + blk * stride_b + offs_t[:, None] * stride_t + kvh * stride_h + offs_d[None, :],
                mask=t_ok[:, None] & d_ok[None, :], other=0)
    if KV_KIND == 2:
        x = _fp8_to_f32(x, False)
    elif KV_KIND == 3:
        x = _fp8_to_f32(x, True)
    else:
        x = x.to(tl.float32)
    if SCALE_KIND == 1:
        s = tl.load(scale_ptr + blk * stride_sb + offs_t * stride_st + kvh * stride_sh, mask=t_ok, other=0)
        x = x * s.to(tl.float32)[:, None]
    elif SCALE_KIND == 2:
        x = x * tl.load(scale_ptr + kvh).to(tl.float32)
    elif SCALE_KIND == 3:
        x = x * tl.load(scale_ptr).to(tl.float32)
    elif SCALE_KIND == 4:
        c = tl.load(scale_ptr + kvh * HEAD_DIM + offs_d, mask=d_ok, other=0).to(tl.float32)
        x = x * c[None, :]
    return x


@triton.jit
def _dot(a, b, EXACT: tl.constexpr):
    """``a @ b`` accumulated in fp32: IEEE fp32 products (``EXACT``), else fp16 tensor-core
    products (softmax weights lie in [0, 1]; queries, keys and values well within fp16's
    range: 10 mantissa bits to bf16's 7, and the same code runs under the interpreter)."""
    if EXACT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(tl.float16), b.to(tl.float16))


@triton.jit
def _attend_page(j, m_i, l_i, acc, q, sq, pos, row_ok, ctx, window, sinks, scale, softcap,
                 k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, toff, kvh, offs_d, d_ok,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_KIND: tl.constexpr,
                 K_SCALE_KIND: tl.constexpr, V_SCALE_KIND: tl.constexpr, HAS_SINK_Q: tl.constexpr,
                 USE_SOFTCAP: tl.constexpr, EXACT: tl.constexpr):
    """Page ``j`` of the sequence into the running softmax state ``(m_i, l_i, acc)``."""
    blk = tl.load(tables_ptr + toff + j)
    offs_t = tl.arange(0, BLOCK_SIZE)
    col = j * BLOCK_SIZE + offs_t
    t_ok = col < ctx
    k = _load_page(k_ptr, k_scale_ptr, blk, kvh, offs_t, t_ok, offs_d, d_ok, stride_kb, stride_kt, stride_kh,
                   stride_ksb, stride_kst, stride_ksh, HEAD_DIM, KV_KIND, K_SCALE_KIND)
    s = _dot(q, tl.trans(k), EXACT) * scale                                   # [BLOCK_M, BLOCK_SIZE]
    if HAS_SINK_Q:  # a sink before a row's window is scored by the row's query at its cache position
        before = (col[None, :] < sinks) & (col[None, :] <= pos[:, None] - window)
        s = tl.where(before, _dot(sq, tl.trans(k), EXACT) * scale, s)
    if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    visible = (col[None, :] <= pos[:, None]) & (col[None, :] < ctx) & row_ok[:, None]
    if window > 0:
        visible = visible & ((col[None, :] > pos[:, None] - window) | (col[None, :] < sinks))
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    v = _load_page(v_ptr, v_scale_ptr, blk, kvh, offs_t, t_ok, offs_d, d_ok, stride_vb, stride_vt, stride_vh,
                   stride_vsb, stride_vst, stride_vsh, HEAD_DIM, KV_KIND, V_SCALE_KIND)
    acc = acc * alpha[:, None] + _dot(p, v, EXACT)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, sq_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, seq_info_ptr, tables_ptr,
        tile_seq_ptr, tile_first_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
        scale, softcap, window, sinks, pages_per_split, num_tokens, num_heads,
        stride_qt, stride_qh, stride_sqt, stride_sqh, stride_ot, stride_oh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, KV_KIND: tl.constexpr, K_SCALE_KIND: tl.constexpr,
        V_SCALE_KIND: tl.constexpr, HAS_SINK_Q: tl.constexpr, USE_SOFTCAP: tl.constexpr, EXACT: tl.constexpr,
        SPLIT: tl.constexpr):
    tile, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q_first = tl.load(tile_first_ptr + tile)
    q_start = tl.load(seq_info_ptr + seq * 5)
    q_len = tl.load(seq_info_ptr + seq * 5 + 1)
    ctx = tl.load(seq_info_ptr + seq * 5 + 2)
    toff = tl.load(seq_info_ptr + seq * 5 + 3)
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_first + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    pos = ctx - q_len + q_local                                            # each row's position
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    rows = (q_start + q_local)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + rows, mask=row_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
    sq = q
    if HAS_SINK_Q:
        sq_rows = (q_start + q_local)[:, None] * stride_sqt + head[:, None] * stride_sqh + offs_d[None, :]
        sq = tl.load(sq_ptr + sq_rows, mask=row_ok[:, None] & d_ok[None, :], other=0).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    last = ctx - q_len + tl.minimum(q_first + BLOCK_Q, q_len) - 1         # the tile's last row position
    end = last // BLOCK_SIZE + 1
    lo = ctx * 0
    sink_end = ctx * 0
    if window > 0:  # pages wholly before every row's window hold nothing it sees, but sinks
        lo = tl.maximum(ctx - q_len + q_first - window + 1, 0) // BLOCK_SIZE
        sink_end = tl.minimum((sinks + BLOCK_SIZE - 1) // BLOCK_SIZE, lo)
    first, stop = lo, end
    if SPLIT:  # flash-decoding: this program's share of the pages (the sinks' go to split 0)
        first = lo + split * pages_per_split
        stop = tl.minimum(first + pages_per_split, end)
        sink_end = tl.where(split == 0, sink_end, 0)
    for k in range(0, sink_end + stop - first):  # the sink pages, then the window's (never overlapping)
        j = tl.where(k < sink_end, k, first + k - sink_end)
        m_i, l_i, acc = _attend_page(
            j, m_i, l_i, acc, q, sq, pos, row_ok, ctx, window, sinks, scale, softcap, k_ptr, v_ptr,
            k_scale_ptr, v_scale_ptr, tables_ptr, toff, kvh, offs_d, d_ok, stride_kb, stride_kt, stride_kh,
            stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
            HEAD_DIM, BLOCK_SIZE, KV_KIND, K_SCALE_KIND, V_SCALE_KIND, HAS_SINK_Q, USE_SOFTCAP, EXACT)
    if SPLIT:  # partials: [splits, T, H] maxima and sums, [splits, T, H, D] unnormalized outputs
        idx = (split * num_tokens + q_start + q_local) * num_heads + head
        tl.store(part_m_ptr + idx, m_i, mask=row_ok)
        tl.store(part_l_ptr + idx, l_i, mask=row_ok)
        tl.store(part_o_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_rows = (q_start + q_local)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_rows, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(out_ptr, part_m_ptr, part_l_ptr, part_o_ptr, num_tokens, num_heads, stride_ot, stride_oh,
                    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Flash-decoding's second pass: one (token, head) row from its splits' partials."""
    t, h = tl.program_id(0), tl.program_id(1)
    idx = (tl.arange(0, NUM_SPLITS) * num_tokens + t) * num_heads + h
    m = tl.load(part_m_ptr + idx)
    top = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))  # an empty split: weight 0
    total = tl.sum(w * tl.load(part_l_ptr + idx), axis=0)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    o = tl.load(part_o_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(int(n)))


def _scale_args(scale: torch.Tensor | None, cache: torch.Tensor) -> tuple[int, torch.Tensor | None, tuple]:
    """(scale kind, tensor, per-token strides) of a scale layout (see the module docstring)."""
    if scale is None:
        return NO_SCALE, None, (0, 0, 0)
    if scale.dim() == 3:
        return PER_TOKEN_HEAD, scale, tuple(scale.stride())
    if scale.dim() == 2:
        return PER_CHANNEL, scale.contiguous(), (0, 0, 0)
    return (PER_TENSOR if scale.numel() == 1 else PER_HEAD), scale.contiguous(), (0, 0, 0)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_attention_triton` takes these inputs: caches of one supported
    dtype, contiguous along head_dim, a power-of-two block size (16 or more on a GPU: tensor
    cores' smallest tile), whole GQA groups."""
    bs = k_cache.shape[1]
    return (k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_KINDS and q.shape[1] % k_cache.shape[2] == 0
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and bs & (bs - 1) == 0
            and (bs >= 16 or not q.is_cuda))


def _tiles(seq_info: torch.Tensor, block_q: int) -> tuple[list[int], list[int]]:
    """Each program's (sequence, first query row): ``ceil(query_len / block_q)`` per sequence."""
    seqs, firsts = [], []
    for s, n in enumerate(seq_info[:, 1].tolist()):
        for first in range(0, n, block_q):
            seqs.append(s)
            firsts.append(first)
    return seqs, firsts


def auto_splits(q: torch.Tensor, num_programs: int, max_pages: int) -> int:
    """Flash-decoding splits: on a GPU, when the step's programs are too few to fill it
    (small batch) and contexts are long; a power of two, at most 16."""
    if not q.is_cuda or max_pages < 16 or num_programs >= 256:
        return 1
    return min(16, _pow2(-(-256 // max(1, num_programs))), _pow2(max_pages // 8))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           window: int = 0, sinks: int = 0, sink_q: torch.Tensor | None = None, softcap: float = 0.0,
                           exact: bool | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Attention of a step's queries over paged KV (the module's contract); returns
    ``[T, H, D]`` in ``q``'s dtype. ``exact``: fp32 products in IEEE precision (default: when
    ``q`` is fp32); ``num_splits``: flash-decoding's page splits per sequence (default: auto).

    Raises:
        ValueError: inputs :func:`supports` does not take.
    """
    if not supports(q, k_cache, v_cache):
        raise ValueError(f"the Triton attention kernel does not take q {tuple(q.shape)} {q.dtype} with a cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()  # (rows and heads may have any strides: q and sink_q their own)
    sink_q = sink_q if sink_q is None or sink_q.stride(-1) == 1 else sink_q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    if meta.kernel_args is not None:  # laid out on the device already: nothing read back (CUDA graphs)
        a = meta.kernel_args
        seq_info, tables, tile_seq, tile_first = a.seq_info, a.tables, a.tile_seq, a.tile_first
        block_m, max_pages, splits, num_tiles = _pow2(group, 16), a.max_pages, a.num_splits, a.tile_seq.numel()
        block_q = block_m // group
    else:
        seq_info_cpu, tables = meta.packed
        if not seq_info_cpu.numel():
            return out
        block_m = _pow2(group, 16) if int(seq_info_cpu[:, 1].max()) <= 16 else _pow2(group, 64)
        block_q = block_m // group
        seqs, firsts = _tiles(seq_info_cpu, block_q)
        if not seqs:
            return out
        max_pages = -(-int(seq_info_cpu[:, 2].max()) // block_size)
        splits, num_tiles = num_splits or auto_splits(q, len(seqs) * kv_heads, max_pages), len(seqs)
        tile_seq = torch.tensor(seqs, dtype=torch.int64, device=q.device)
        tile_first = torch.tensor(firsts, dtype=torch.int64, device=q.device)
        seq_info, tables = seq_info_cpu.to(q.device), tables.to(q.device)
    dev = q.device
    kind = KV_KINDS[k_cache.dtype]
    kc, vc = (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if kind >= FP8_E4M3 else (k_cache, v_cache)
    ks_kind, ks, ks_strides = _scale_args(k_scale, k_cache)
    vs_kind, vs, vs_strides = _scale_args(v_scale, v_cache)
    use_sink_q = sink_q is not None and sinks > 0 and window > 0
    if splits > 1:
        # (rows of padding sequences get no partials: these defaults combine to 0 there)
        part_m = torch.full((splits, num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=dev)
        part_l = torch.zeros_like(part_m)
        part_o = torch.zeros(splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=dev)
    else:
        part_m = part_l = part_o = out
    _paged_attention_kernel[(num_tiles, kv_heads, splits)](
        out, q, sink_q if use_sink_q else q, kc, vc, ks if ks is not None else q, vs if vs is not None else q,
        seq_info, tables, tile_seq, tile_first, part_m, part_l, part_o,
        float(scale), float(softcap), int(window), int(sinks), -(-max_pages // splits), num_tokens, num_heads,
        q.stride(0), q.stride(1), *(sink_q if use_sink_q else q).stride()[:2], out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), *ks_strides, *vs_strides,
        HEAD_DIM=head_dim, D_PAD=_pow2(head_dim, 16), BLOCK_SIZE=block_size, GROUP=group, BLOCK_Q=block_q,
        BLOCK_M=block_m, KV_KIND=kind, K_SCALE_KIND=ks_kind, V_SCALE_KIND=vs_kind, HAS_SINK_Q=use_sink_q,
        USE_SOFTCAP=softcap > 0, EXACT=q.dtype == torch.float32 if exact is None else bool(exact), SPLIT=splits > 1)
    if splits > 1:
        _combine_kernel[(num_tokens, num_heads)](out, part_m, part_l, part_o, num_tokens, num_heads, out.stride(0),
                                                 out.stride(1), NUM_SPLITS=splits, HEAD_DIM=head_dim,
                                                 D_PAD=_pow2(head_dim, 16))
    return out
