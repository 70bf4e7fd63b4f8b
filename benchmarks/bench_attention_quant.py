"""Decode attention over quantized pages: the fused kernel reading int8 / fp8 pages (each page
dequantized in-kernel into an L1-sized buffer) against the same kernel on float32 and float16
pages, at long contexts where the KV read dominates (goal: int8 >= 1.5x faster than
float32 at 4,096 tokens). The pure-torch reference on int8 pages (gather + dequantized copy)
is timed too, for contrast.

Per-token-head scales (the default), shuffled block tables, several KV sets rotated so each
call streams its pages from memory, medians over ``--rounds``; this machine's read bandwidth
is measured in the same run and each time is also given as a multiple of its bytes bound
(stored page bytes + scales + q/out, divided by the measured bandwidth).

    python benchmarks/bench_attention_quant.py                      # about a minute on 2 cores
    python benchmarks/bench_attention_quant.py --batch 8 --context 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from bench_attention import Ceilings, timed

import pagedkv  # noqa: F401  (numerics as the engine runs them)
from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
from pagedkv.attention.reference import paged_attention_reference
from pagedkv.kernels.cpu.library import load_kernel
from pagedkv.kv_cache import quant

MIB = 2 ** 20
DTYPES = ("float32", "float16", "int8", "fp8_e4m3", "fp8_e5m2")


def kv_set(dtype: str, batch: int, context: int, kv_heads: int, head_dim: int, block_size: int) -> dict:
    """One layer's pages for ``batch`` sequences of ``context`` tokens, shuffled tables."""
    pages = -(-context // block_size)
    n = batch * pages + 3
    out: dict = {}
    for name in ("k", "v"):
        x = torch.randn(n * block_size, kv_heads, head_dim)
        if dtype in quant.QMAX:
            s = quant.compute_scales(x, dtype, "per-token-head")
            out[name] = quant.quantize(x, quant.scale_view(s, "per-token-head"), dtype)
            out[name] = out[name].view(n, block_size, kv_heads, head_dim)
            out[name + "_scale"] = s.view(n, block_size, kv_heads)
        else:
            out[name] = x.view(n, block_size, kv_heads, head_dim).to(getattr(torch, dtype))
            out[name + "_scale"] = None
    tables = torch.randperm(n)[:batch * pages].view(batch, pages)
    out["meta"] = AttentionMetadata(torch.zeros(batch, dtype=torch.int64),
                                    [SeqAttention(i, 1, context, tables[i]) for i in range(batch)])
    out["meta"].packed  # built once per step in the engine; not timed
    out["bytes"] = sum(t.numel() * t.element_size() for k, t in out.items()
                       if isinstance(t, torch.Tensor) and k in ("k", "v", "k_scale", "v_scale")) * (batch * pages) // n
    return out


def run_kernel(op, q, s, scale):
    if s["k_scale"] is None:
        return op(q, s["k"], s["v"], *s["meta"].packed, scale)
    return op(q, s["k"], s["v"], *s["meta"].packed, scale, -1, s["k_scale"], s["v_scale"])


def measure(args, op, ceilings: Ceilings) -> dict:
    q = torch.randn(args.batch, args.heads, args.head_dim)                        # [B, H, D]
    scale = args.head_dim ** -0.5
    sets = {d: [kv_set(d, args.batch, args.context, args.kv_heads, args.head_dim, args.block_size)
                for _ in range(args.sets)] for d in DTYPES}
    calls = {f"kernel {d}": (lambda s: run_kernel(op, q, s, scale), d) for d in DTYPES}
    calls["reference int8"] = (lambda s: paged_attention_reference(q, s["k"], s["v"], s["meta"], scale,
                                                                  s["k_scale"], s["v_scale"]), "int8")
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for name, (fn, d) in calls.items():  # warm-up
        fn(sets[d][0])
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
            fn, d = calls[name]
            times[name].append(timed(lambda: fn(sets[d][r % args.sets])))
        ceilings.sample()
    io = 2 * q.numel() * 4
    rows = {}
    for name, (fn, d) in calls.items():
        ms = statistics.median(times[name]) * 1e3
        bound = (sets[d][0]["bytes"] + io) / ceilings.bandwidth * 1e3
        rows[name] = {"ms": ms, "kv_bytes": sets[d][0]["bytes"], "bound_ms": bound, "vs_bound": ms / bound}
    base = rows["kernel float32"]["ms"]
    for r in rows.values():
        r["speedup_vs_float32"] = base / r["ms"]
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=15, help="timed calls of each implementation (median)")
    p.add_argument("--sets", type=int, default=6, help="KV sets rotated per dtype (defeat the caches)")
    p.add_argument("--threads", type=int, help="torch/OpenMP threads (default: torch's)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    op, ceilings = load_kernel(), Ceilings()
    rows = measure(args, op, ceilings)
    print(f"decode attention, batch {args.batch} x {args.context} tokens, {args.heads} query / {args.kv_heads} KV "
          f"heads, head_dim {args.head_dim}, block {args.block_size}, {torch.get_num_threads()} threads, "
          f"per-token-head scales, medians of {args.rounds}")
    print(f"{'implementation':<20} {'KV MB':>8} {'ms':>8} {'bound ms':>9} {'x bound':>8} {'vs fp32':>8}")
    for name, r in rows.items():
        print(f"{name:<20} {r['kv_bytes'] / 1e6:>8.1f} {r['ms']:>8.3f} {r['bound_ms']:>9.3f} {r['vs_bound']:>7.2f}x "
              f"{r['speedup_vs_float32']:>7.2f}x")
    bw = ceilings.bandwidth / 1e9
    print(f"measured read bandwidth {bw:.1f} GB/s (torch.dot, 2 x 128 MiB, median over rounds)")
    s = rows["kernel int8"]["speedup_vs_float32"]
    print(f"goal int8 pages >= 1.5x faster than float32 pages: {s:.2f}x -> {'met' if s >= 1.5 else 'NOT met'}")
    result = {"args": vars(args), "threads": torch.get_num_threads(), "read_bandwidth_GBps": bw, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
