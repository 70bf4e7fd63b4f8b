"""The attention kernel per instruction set: prefill and decode shapes, one build per -march.

On one machine, builds the kernel for each ``--march`` (``PAGEDKV_KERNEL_MARCH``, e.g.
``native`` and ``x86-64-v3`` = AVX2 + FMA, which an AVX-512 machine also runs) in its own
subprocess and times SmolLM2's attention shapes (9 query / 3 KV heads, head_dim 64, fp32
pages of 16 tokens):

- prefill: one 2,048-row chunk at the end of a 4,096-token context; FLOPs
  ``4 * heads * head_dim * sum_i (keys seen by row i)``, reported as GFLOP/s;
- decode: 16 sequences x 1 query over 2,048 tokens each, rotating over 8 KV sets so pages
  come from memory; reported as GB/s of K+V read.

Medians of ``--rounds`` calls. An AVX2-only CPU runs the ``x86-64-v3`` code as its native
build, so this shows, on an AVX-512 machine, how the kernel's AVX2 paths compare.

    python benchmarks/lab/bench_attention_isa.py --march native,x86-64-v3 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

H, HKV, D, BS = 9, 3, 64, 16


def _median_time(fn, rounds: int) -> float:
    ts = []
    for r in range(rounds):
        t = time.perf_counter()
        fn(r)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure(rounds: int) -> dict:
    """Both shapes with the kernel this process builds (``PAGEDKV_KERNEL_MARCH`` is set)."""
    import torch

    from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
    from pagedkv.kernels.cpu import library as kernel
    from pagedkv.kernels.cpu.library import load_kernel

    if not hasattr(kernel, "cflags"):  # a checkout from before PAGEDKV_KERNEL_MARCH (PYTHONPATH=old/src)
        kernel.CFLAGS = ["-O3", f"-march={os.environ['PAGEDKV_KERNEL_MARCH']}", "-fopenmp"]

    op, scale = load_kernel(), D ** -0.5
    torch.manual_seed(0)
    ctx, ql = 4096, 2048
    k, v = torch.randn(ctx // BS + 1, BS, HKV, D), torch.randn(ctx // BS + 1, BS, HKV, D)
    q = torch.randn(ql, H, D)
    seq = SeqAttention(0, ql, ctx, torch.randperm(ctx // BS) + 1)
    si, tb = AttentionMetadata(torch.zeros(ql, dtype=torch.int64), [seq]).packed
    prefill_s = _median_time(lambda r: op(q, k, v, si, tb, scale), rounds)
    flops = 4 * H * D * sum(ctx - ql + i + 1 for i in range(ql))

    batch, ctx, sets = 16, 2048, 8
    per = ctx // BS
    ks = [torch.randn(batch * per + 1, BS, HKV, D) for _ in range(sets)]
    vs = [torch.randn(batch * per + 1, BS, HKV, D) for _ in range(sets)]
    qd, perm = torch.randn(batch, H, D), torch.randperm(batch * per) + 1
    seqs = [SeqAttention(i, 1, ctx, perm[i * per:(i + 1) * per]) for i in range(batch)]
    si, tb = AttentionMetadata(torch.zeros(batch, dtype=torch.int64), seqs).packed
    decode_s = _median_time(lambda r: op(qd, ks[r % sets], vs[r % sets], si, tb, scale), 5 * rounds)
    kv_bytes = batch * ctx * HKV * D * 2 * 4
    return {"prefill_ms": prefill_s * 1e3, "prefill_gflops": flops / prefill_s / 1e9,
            "decode_ms": decode_s * 1e3, "decode_kv_gb_per_s": kv_bytes / decode_s / 1e9}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--march", default="native,x86-64-v3", help="comma-separated -march values")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.rounds)))
        return 0
    rows = []
    for march in a.march.split(","):
        env = dict(os.environ, PAGEDKV_KERNEL_MARCH=march)
        out = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(a.rounds)], env=env,
                             capture_output=True, text=True, check=True).stdout
        rows.append({"march": march} | json.loads(out.splitlines()[-1]))
    if a.json:
        print(json.dumps(rows))
        return 0
    print(f"{'-march':>12} {'prefill ms':>11} {'GFLOP/s':>8} {'decode ms':>10} {'KV GB/s':>8}")
    for r in rows:
        print(f"{r['march']:>12} {r['prefill_ms']:>11.1f} {r['prefill_gflops']:>8.1f} {r['decode_ms']:>10.3f} "
              f"{r['decode_kv_gb_per_s']:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
