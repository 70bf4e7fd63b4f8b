"""The Triton paged-attention kernel at real sizes, for ``gpu_check.py``: correctness against
the pure-torch reference (fp32 products) for each page dtype, and its speed beside the
machine's copy and matrix ceilings and torch's own attention over contiguous KV.

Inputs are drawn fresh for every case (seeded); every slot no sequence reads holds NaN, so a
read the kernel's masks let through shows in the output, and the output's memory is poisoned
with NaN just before each launch (the caching allocator hands the same block back).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from gpu_step_profile import graphed, timer

from pagedkv.attention.metadata import AttentionMetadata, KernelArgs, SeqAttention
from pagedkv.attention.reference import paged_attention_reference
from pagedkv.kernels.triton.paged_attention import auto_splits, paged_attention_triton
from pagedkv.kv_cache import quant

# (name, heads, kv_heads, head_dim, [(query_len, context_len)], page dtype, extra kernel args)
LLAMA8B = (32, 8, 128)
MIXED = [(1, c) for c in (1, 15, 16, 17, 700, 2048, 4095, 8192)] + [(256, 2048), (512, 512), (1, 3000)]
CASES = [
    ("llama8b-mixed-fp32", *LLAMA8B, MIXED, "float32", {}),
    ("llama8b-mixed-bf16", *LLAMA8B, MIXED, "bfloat16", {}),
    ("llama8b-mixed-fp16", *LLAMA8B, MIXED, "float16", {}),
    ("llama8b-mixed-int8", *LLAMA8B, MIXED, "int8", {}),
    ("llama8b-mixed-fp8e4m3", *LLAMA8B, MIXED, "fp8_e4m3", {}),
    ("llama8b-mixed-fp8e5m2", *LLAMA8B, MIXED, "fp8_e5m2", {}),
    ("smollm2-decode-16k-splits8", 9, 3, 64, [(1, 16384)] * 4, "bfloat16", {"num_splits": 8}),
    ("mqa-head-dim-80", 16, 1, 80, [(1, 999), (64, 300)], "bfloat16", {}),
    ("gemma2-window-sinks-softcap", 16, 8, 256, [(1, 6000), (128, 5000)], "bfloat16",
     {"window": 4096, "sinks": 4, "softcap": 50.0}),
]
QUICK_MIXED = [(1, 1), (1, 17), (5, 37), (1, 40)]
QUICK_CASES = [(n, 4, 2, 32 if d >= 64 else d, QUICK_MIXED, dt, kw) for n, _h, _k, d, _s, dt, kw in CASES]
SMALL_MIXED = [(1, 1), (1, 17), (1, 2048), (64, 300), (5, 37)]  # memcheck runs kernels ~100x slower
SANITIZE_CASES = [("sanitize-mixed-bf16", *LLAMA8B, SMALL_MIXED, "bfloat16", {}),
                  ("sanitize-mixed-fp8e4m3", *LLAMA8B, SMALL_MIXED, "fp8_e4m3", {}),
                  ("sanitize-mixed-int8-splits4", *LLAMA8B, SMALL_MIXED, "int8", {"num_splits": 4}),
                  ("sanitize-mqa-head-dim-80", 16, 1, 80, SMALL_MIXED, "float32", {})]
TOLERANCE = {"float32": 1e-5}  # relative error ||out - ref|| / ||ref||; else 1e-2 (fp16 dot operands)


def make_batch(specs, heads, kv_heads, head_dim, device, seed, block_size=16, spare=8, dtype=torch.float32):
    """Random ``q`` ``[T, heads, head_dim]`` and fp32 pages ``[num_blocks, block_size, kv_heads,
    head_dim]`` for sequences ``specs`` with shuffled block tables; unread slots hold NaN."""
    g = torch.Generator(device=device).manual_seed(seed)
    need = sum(-(-ctx // block_size) for _, ctx in specs)
    shape = (need + spare, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=g, device=device)
    v = torch.randn(shape, generator=g, device=device)
    unread = torch.ones(shape[:2], dtype=torch.bool, device=device)
    pool = torch.randperm(need + spare, generator=torch.Generator().manual_seed(seed))
    seqs, row, used = [], 0, 0
    for query_len, ctx in specs:
        n = -(-ctx // block_size)
        table = pool[used:used + n].clone()
        unread.view(-1)[(table[:, None] * block_size + torch.arange(block_size)).view(-1)[:ctx].to(device)] = False
        seqs.append(SeqAttention(row, query_len, ctx, table))
        used, row = used + n, row + query_len
    k[unread], v[unread] = float("nan"), float("nan")
    q = torch.randn(row, heads, head_dim, generator=g, device=device, dtype=dtype)
    return q, k, v, AttentionMetadata(torch.zeros(row, dtype=torch.int64), seqs)


def store(x: torch.Tensor, dtype: str):
    """Pages as the KV cache stores them in ``dtype``, and their per-token-head scales
    (``[num_blocks, block_size, kv_heads]`` bf16; NaN where unwritten) or None."""
    if dtype in ("float32", "float16", "bfloat16"):
        return x.to(getattr(torch, dtype)), None
    written = torch.isfinite(x[..., 0])
    flat = torch.nan_to_num(x, nan=0.0)
    nb, bs, hkv, d = x.shape
    s = quant.round_up_to_bfloat16(quant.compute_scales(flat.view(-1, hkv, d), dtype, "per-token-head"))
    s = s.view(nb, bs, hkv)
    pages = quant.quantize(flat, s.float().unsqueeze(-1), dtype)
    return pages, s.float().masked_fill(~written, float("nan")).to(torch.bfloat16)


def _finite(x):
    return torch.nan_to_num(x, nan=0.0) if x.is_floating_point() and x.element_size() > 1 else x


def check_case(case, device, seed: int) -> dict:
    """One case's kernel output against the reference: relative error, worst element,
    whether every output is finite."""
    name, heads, kv_heads, head_dim, specs, dtype, kw = case
    q, k, v, meta = make_batch(specs, heads, kv_heads, head_dim, device, seed,
                               dtype=torch.float32 if dtype == "float32" else torch.bfloat16)
    (kq, ks), (vq, vs) = store(k, dtype), store(v, dtype)
    sink_q = torch.randn_like(q) if kw.get("sinks") else None
    scale = head_dim ** -0.5
    ref = paged_attention_reference(q, _finite(kq), _finite(vq), meta, scale, _finite(ks) if ks is not None else None,
                                    _finite(vs) if vs is not None else None, sink_q=sink_q,
                                    **{a: b for a, b in kw.items() if a != "num_splits"}).float()
    poison = torch.full_like(q, float("nan"))
    del poison  # its block comes back as the kernel's output
    out = paged_attention_triton(q, kq, vq, meta, scale, ks, vs, sink_q=sink_q, **kw).float()
    err = float((out - ref).norm() / ref.norm())
    finite = bool(torch.isfinite(out).all())
    tol = TOLERANCE.get(dtype, 1e-2)
    return {"case": name, "tokens": q.shape[0], "page_dtype": dtype, "rel_err": err,
            "max_abs_err": float((out - ref).abs().max()), "finite": finite, "tolerance": tol,
            "ok": finite and err < tol}


def check_kernels(device, quick: bool, only=None) -> list[dict]:
    cases = QUICK_CASES if quick else CASES
    return [check_case(c, device, seed) for seed, c in enumerate(cases) if only is None or c[0] in only]


def device_meta(q: torch.Tensor, meta: AttentionMetadata, kv_heads: int) -> AttentionMetadata:
    """A decode batch's layout on the device, as the engine's CUDA graphs pass it (one
    program per sequence; nothing read back at launch)."""
    seq_info, tables = (t.to(q.device) for t in meta.packed)
    n, max_pages = seq_info.shape[0], int(meta.packed[0][:, 4].max())
    args = KernelArgs(seq_info, tables, torch.arange(n, device=q.device), torch.zeros(n, dtype=torch.int64,
                      device=q.device), max_pages, auto_splits(q, n * kv_heads, max_pages))
    return AttentionMetadata(meta.slot_mapping, [], args)


def _median_seconds(fn, device, repeats: int) -> float:
    """Median seconds of ``fn()`` after a warm-up (CUDA events on a GPU)."""
    run = timer(torch.device(device))
    run(fn, 3)
    return statistics.median(run(fn, repeats))


def _sdpa_peer(batch, ctx, heads, kv_heads, head_dim, device, causal=False, q_len=1):
    """torch's attention over the same KV laid out contiguously (flash kernel where it can)."""
    q = torch.randn(batch, heads, q_len, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def time_kernels(device, quick: bool, ceilings: dict, repeats: int) -> list[dict]:
    """Decode attention (bytes-bound: K and V pages read once) and a long prefill
    (FLOP-bound), against the copy and matrix ceilings and torch's attention."""
    shape = (4, 2, 32) if quick else LLAMA8B
    decode = [(64, 4096, "bfloat16"), (8, 16384, "bfloat16"), (8, 16384, "fp8_e4m3"), (1, 16384, "bfloat16"),
              (1, 16384, "fp8_e4m3")]
    prefill = [8192]
    if quick:
        decode, prefill = [(2, 64, "bfloat16"), (2, 64, "fp8_e4m3")], [32]
    rows = [time_decode(batch, ctx, dtype, shape, device, ceilings, repeats) for batch, ctx, dtype in decode]
    return rows + [time_prefill(tokens, shape, device, ceilings, repeats) for tokens in prefill]


def time_decode(batch: int, ctx: int, dtype: str, shape, device, ceilings: dict, repeats: int) -> dict:
    """``batch`` decodes over ``ctx`` cached tokens each, laid out as the engine's CUDA
    graphs pass them, replayed from a graph: K/V bytes read over the copy ceiling."""
    heads, kv_heads, head_dim = shape
    q, k, v, meta = make_batch([(1, ctx)] * batch, heads, kv_heads, head_dim, device, 7, spare=0,
                               dtype=torch.bfloat16)
    (kq, ks), (vq, vs) = store(torch.nan_to_num(k), dtype), store(torch.nan_to_num(v), dtype)
    dev_meta = device_meta(q, meta, kv_heads)
    fn = graphed(lambda: paged_attention_triton(q, kq, vq, dev_meta, head_dim ** -0.5, ks, vs), torch.device(device))
    sec = _median_seconds(fn, device, repeats)
    moved = 2 * batch * ctx * kv_heads * (head_dim * kq.element_size() + (2 if ks is not None else 0))
    peer = _median_seconds(_sdpa_peer(batch, ctx, heads, kv_heads, head_dim, device), device, repeats)
    return {"kind": "decode", "batch": batch, "context": ctx, "page_dtype": dtype, "seconds": sec,
            "kv_bytes": moved, "bytes_per_s": moved / sec,
            "of_copy_ceiling": moved / sec / ceilings["copy_bytes_per_s"],
            "splits": dev_meta.kernel_args.num_splits, "sdpa_contiguous_bf16_seconds": peer}


def time_prefill(tokens: int, shape, device, ceilings: dict, repeats: int) -> dict:
    """One causal prompt of ``tokens`` over bf16 pages: its FLOPs over the matrix ceiling."""
    heads, kv_heads, head_dim = shape
    q, k, v, meta = make_batch([(tokens, tokens)], heads, kv_heads, head_dim, device, 8, spare=0,
                               dtype=torch.bfloat16)
    k, v = torch.nan_to_num(k).to(torch.bfloat16), torch.nan_to_num(v).to(torch.bfloat16)
    sec = _median_seconds(lambda: paged_attention_triton(q, k, v, meta, head_dim ** -0.5), device, repeats)
    flops = 4 * heads * head_dim * tokens * (tokens + 1) / 2  # QK^T and PV over the causal half
    peer = _median_seconds(_sdpa_peer(1, tokens, heads, kv_heads, head_dim, device, causal=True, q_len=tokens),
                           device, repeats)
    return {"kind": "prefill", "batch": 1, "context": tokens, "page_dtype": "bfloat16", "seconds": sec,
            "flops": flops, "flops_per_s": flops / sec,
            "of_matmul_ceiling": flops / sec / ceilings["matmul_flops_per_s"],
            "sdpa_contiguous_bf16_seconds": peer}
