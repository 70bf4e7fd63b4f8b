"""Decode attention micro-benchmark: the fused paged kernel vs the pure-torch reference vs
torch SDPA on contiguous K/V of the same shape, each against this machine's bounds.

    python benchmarks/bench_attention.py                  # batch 16, 2,048 tokens, 9/3 heads, d 64 + sweep
    python benchmarks/bench_attention.py --rounds 40 --no-sweep --json attention.json

Count first. A decode step (one query per sequence) reads every K and V once:
``bytes = batch * context * kv_heads * head_dim * 2 * itemsize`` (+ q and out), and does
``4 * batch * heads * context * head_dim`` FLOPs (QK^T and PV). The bounds are bytes / read
bandwidth and FLOPs / matmul rate, both measured in this run: read bandwidth as a
``torch.dot`` of two 128 MiB fp32 vectors (two read streams, like K and V; the fastest
read probe tried here, ahead of ``sum`` and ``amax``), matmul rate as a 1024^3 ``torch.mm``.

Timings interleave the implementations (one call of each per round, in a rotating order) so
the noise of this shared machine hits them alike, and report medians over the rounds. Each call uses the next
of ``layers`` independent KV sets (like a model's layers, at least 256 MiB in all when the
memory budget allows) so K/V come from memory rather than from a cache the previous call
warmed. SDPA runs on contiguous ``[batch, kv_heads, context, head_dim]`` K/V with
``enable_gqa=True`` and on K/V expanded to every query head; the faster is the baseline.
SDPA always reads fp32 copies (it has no fp32-query / half-KV path), so with a half-precision
cache it moves twice the kernel's bytes.
The kernel's output is checked against SDPA's on the same values before timing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import pagedkv  # noqa: E402,F401  (numerics as the engine runs them: PAGEDKV_BATCH_INVARIANT)
from pagedkv.attention.metadata import AttentionMetadata, SeqAttention  # noqa: E402
from pagedkv.attention.reference import paged_attention_reference  # noqa: E402
from pagedkv.kernels.cpu.library import load_kernel  # noqa: E402

MIB = 2 ** 20


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class Ceilings:
    """This machine's read bandwidth (bytes/s) and fp32 matmul rate (FLOP/s), sampled per round."""

    def __init__(self) -> None:
        self.x, self.y = torch.randn(128 * MIB // 4), torch.randn(128 * MIB // 4)
        self.a, self.b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        self.bw: list[float] = []
        self.flops: list[float] = []

    def sample(self) -> None:
        self.bw.append(2 * self.x.numel() * 4 / timed(lambda: torch.dot(self.x, self.y)))
        self.flops.append(2 * 1024 ** 3 / timed(lambda: torch.mm(self.a, self.b)))

    @property
    def bandwidth(self) -> float:
        return statistics.median(self.bw)

    @property
    def matmul_rate(self) -> float:
        return statistics.median(self.flops)


class DecodeCase:
    """``layers`` KV sets for ``batch`` sequences of ``context`` tokens, paged with shuffled
    block tables and as contiguous copies for SDPA."""

    def __init__(self, batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, budget_bytes: int, expanded: bool, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.batch, self.context, self.heads, self.kv_heads, self.head_dim = batch, context, heads, kv_heads, head_dim
        self.kv_bytes = batch * context * kv_heads * head_dim * 2 * dtype.itemsize
        expand = heads / kv_heads * 4 / dtype.itemsize if expanded else 0
        per_layer = self.kv_bytes * (1 + 4 / dtype.itemsize + expand)
        self.layers = max(1, min(16, math.ceil(256 * MIB / self.kv_bytes), int(budget_bytes // per_layer)))
        pages = -(-context // block_size)
        self.q = torch.randn(batch, heads, head_dim)                                   # [B, H, D]
        self.sets = []
        for _ in range(self.layers):
            shape = (batch * pages + 3, block_size, kv_heads, head_dim)            # [num_blocks, bs, Hkv, D]
            k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
            tables = torch.randperm(shape[0])[:batch * pages].view(batch, pages)
            meta = AttentionMetadata(torch.zeros(batch, dtype=torch.int64),
                                     [SeqAttention(i, 1, context, tables[i]) for i in range(batch)])
            meta.packed  # built once per step in the engine; not timed here either
            kc, vc = (self.contiguous(c, tables) for c in (k, v))                    # [B, Hkv, L, D] fp32
            ke, ve = ((c.repeat_interleave(heads // kv_heads, 1) if expanded else None) for c in (kc, vc))
            self.sets.append((k, v, meta, kc, vc, ke, ve))

    def contiguous(self, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        flat = cache.index_select(0, tables.flatten()).float()                     # [B * pages, bs, Hkv, D]
        seqs = flat.view(self.batch, -1, self.kv_heads, self.head_dim)[:, :self.context]
        return seqs.transpose(1, 2).contiguous()

    @property
    def flops(self) -> int:
        return 4 * self.batch * self.heads * self.context * self.head_dim

    def implementations(self, op) -> dict:
        scale = self.head_dim ** -0.5
        q4 = self.q.view(self.batch, self.heads, 1, self.head_dim)                 # [B, H, 1, D]
        impls = {
            "kernel": lambda s: op(self.q, s[0], s[1], *s[2].packed, scale),
            "reference": lambda s: paged_attention_reference(self.q, s[0], s[1], s[2], scale),
            "sdpa_gqa": lambda s: F.scaled_dot_product_attention(q4, s[3], s[4], enable_gqa=True),
        }
        if self.sets[0][5] is not None:
            impls["sdpa_expanded"] = lambda s: F.scaled_dot_product_attention(q4, s[5], s[6])
        return impls

    def check(self, op) -> float:
        """Max |kernel - SDPA| on the first KV set (the same values, fp32)."""
        s, q4 = self.sets[0], self.q.view(self.batch, self.heads, 1, self.head_dim)
        ours = op(self.q, s[0], s[1], *s[2].packed, self.head_dim ** -0.5)
        theirs = F.scaled_dot_product_attention(q4, s[3], s[4], enable_gqa=True).view_as(ours)
        return float((ours - theirs).abs().max())


def measure(case: DecodeCase, op, rounds: int, ceilings: Ceilings) -> dict:
    impls = case.implementations(op)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for name, fn in impls.items():  # warm-up
        fn(case.sets[0])
    names = list(impls)
    for r in range(rounds):
        s = case.sets[r % case.layers]
        for name in names[r % len(names):] + names[:r % len(names)]:  # each goes first after the
            times[name].append(timed(lambda: impls[name](s)))          # cache-flushing probes as often
        ceilings.sample()
    med = {name: statistics.median(t) for name, t in times.items()}
    sdpa = min((n for n in med if n.startswith("sdpa")), key=med.get)
    bound_bw = (case.kv_bytes + 2 * case.q.numel() * 4) / ceilings.bandwidth
    bound_flops = case.flops / ceilings.matmul_rate
    return {"batch": case.batch, "context": case.context, "kv_bytes": case.kv_bytes, "layers": case.layers,
            "ms": {n: t * 1e3 for n, t in med.items()}, "sdpa_baseline": sdpa,
            "bound_ms": max(bound_bw, bound_flops) * 1e3, "bound_bytes_ms": bound_bw * 1e3,
            "bound_flops_ms": bound_flops * 1e3,
            "kernel_vs_sdpa": med["kernel"] / med[sdpa], "kernel_vs_reference": med["kernel"] / med["reference"],
            "kernel_vs_bound": med["kernel"] / max(bound_bw, bound_flops)}


def row(res: dict) -> str:
    ms = res["ms"]
    return (f"{res['batch']:>5} {res['context']:>7} {res['kv_bytes'] / 1e6:>8.1f} {res['bound_ms']:>8.3f} "
            f"{ms['kernel']:>8.3f} {ms['reference']:>8.3f} {ms[res['sdpa_baseline']]:>8.3f} "
            f"{res['kernel_vs_sdpa']:>6.2f}x {res['kernel_vs_bound']:>6.2f}x {res['kernel_vs_reference']:>6.2f}x")


HEADER = (f"{'batch':>5} {'context':>7} {'KV MB':>8} {'bound':>8} {'kernel':>8} {'ref':>8} {'sdpa':>8} "
          f"{'k/sdpa':>7} {'k/bound':>7} {'k/ref':>7}   (times: median ms)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=20, help="timed calls of each implementation (median)")
    p.add_argument("--sweep-rounds", type=int, default=7)
    p.add_argument("--memory-budget", type=float, default=1.0, help="GiB of KV sets per case (default 1)")
    p.add_argument("--threads", type=int, help="torch/OpenMP threads (default: torch's)")
    p.add_argument("--no-sweep", action="store_true", help="only the main case")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    op, dtype, budget = load_kernel(), getattr(torch, args.kv_cache_dtype), args.memory_budget * 2 ** 30
    shape = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                 dtype=dtype, budget_bytes=budget)
    ceilings = Ceilings()
    main_case = DecodeCase(args.batch, args.context, expanded=True, **shape)
    err = main_case.check(op)
    assert err < 1e-4, f"kernel and SDPA disagree by {err}"
    result = {"threads": torch.get_num_threads(), "kv_cache_dtype": args.kv_cache_dtype,
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "block_size": args.block_size, "max_abs_diff_vs_sdpa": err}
    result["main"] = measure(main_case, op, args.rounds, ceilings)
    del main_case
    m = result["main"]
    print(f"decode attention, {args.heads} query / {args.kv_heads} KV heads, head_dim {args.head_dim}, "
          f"block {args.block_size}, KV {args.kv_cache_dtype}, {result['threads']} threads, "
          f"{args.rounds} rounds x {m['layers']} KV sets")
    print(HEADER)
    print(row(m))
    print("SDPA: " + ", ".join(f"{n} {t:.3f} ms" for n, t in m["ms"].items() if n.startswith("sdpa"))
          + f" (baseline: {m['sdpa_baseline']}); bound: bytes {m['bound_bytes_ms']:.3f} ms, "
          f"FLOPs {m['bound_flops_ms']:.3f} ms")
    goal = m["kernel_vs_sdpa"] <= 1.3
    print(f"goal kernel <= 1.3x SDPA: {m['kernel_vs_sdpa']:.2f}x -> {'met' if goal else 'NOT met'}")
    if not args.no_sweep:
        print("\nsweep")
        print(HEADER)
        result["sweep"] = []
        for batch in (1, 4, 16, 64):
            for context in (128, 512, 2048):
                res = measure(DecodeCase(batch, context, expanded=False, **shape), op, args.sweep_rounds, ceilings)
                result["sweep"].append(res)
                print(row(res), flush=True)
    result["read_bandwidth_GBps"] = ceilings.bandwidth / 1e9
    result["matmul_GFLOPs"] = ceilings.matmul_rate / 1e9
    print(f"\nmeasured: read bandwidth {result['read_bandwidth_GBps']:.1f} GB/s (torch.dot, 2 x 128 MiB), "
          f"fp32 matmul {result['matmul_GFLOPs']:.0f} GFLOP/s (1024^3), medians over all rounds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
