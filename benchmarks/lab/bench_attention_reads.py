"""Where batch decode attention's read rate goes: pages from memory vs from L3, huge pages.

Times the fused kernel on a batch of decodes over ``--layers`` independent fp32 KV pools
(SmolLM2's 9 query / 3 KV heads of 64, pages of 16 tokens), one call per layer as a decode
step makes, and reports ms per step and the KV bytes read per second (K + V of every
sequence's context, GB = 1e9 bytes). With ``--layers 1`` the one pool is read over and over,
so a pool under the L3 size comes from cache: the kernel's own rate. Run it with
``OMP_NUM_THREADS=1`` for one core's rates.

    python benchmarks/lab/bench_attention_reads.py                          # 64 x 200 tokens, 30 layers
    OMP_NUM_THREADS=1 python benchmarks/lab/bench_attention_reads.py --layers 1 --order address
    python benchmarks/lab/bench_attention_reads.py --huge-pages             # pools on 2 MiB pages

``--order shuffled`` hands out pages at random (block tables after much churn), ``address``
in address order (a freshly prefilled batch). ``--huge-pages`` allocates each pool with
``mmap`` and ``madvise(MADV_HUGEPAGE)`` before its first touch (transparent huge pages in
``madvise`` mode) and prints the process's ``AnonHugePages``. Medians of ``--repeats`` steps,
``--rounds`` times.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time

import torch

H, HKV, D, BS = 9, 3, 64, 16
MADV_HUGEPAGE = 14  # linux/mman.h
HUGE = 2 << 20


def pool(num_blocks: int, huge: bool) -> tuple[object, torch.Tensor]:
    """A [num_blocks, BS, HKV, D] fp32 pool of normal values (and the mmap keeping it alive)."""
    n = num_blocks * BS * HKV * D
    if not huge:
        return None, torch.randn(num_blocks, BS, HKV, D)
    size = (n * 4 + HUGE - 1) // HUGE * HUGE
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    if ctypes.CDLL("libc.so.6", use_errno=True).madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size),
                                                        MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    t = torch.frombuffer(m, dtype=torch.float32)[:n].view(num_blocks, BS, HKV, D)
    t.normal_()
    return m, t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=200, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=30, help="independent KV pools, one call each a step")
    p.add_argument("--order", choices=("shuffled", "address"), default="shuffled")
    p.add_argument("--huge-pages", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()

    from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
    from pagedkv.kernels.cpu.library import load_kernel

    op, scale = load_kernel(), D ** -0.5
    torch.manual_seed(0)
    per = -(-a.context // BS)
    num_blocks = a.batch * per * a.layers + 1  # page 0: the null page
    keep_k, k = pool(num_blocks, a.huge_pages)
    keep_v, v = pool(num_blocks, a.huge_pages)
    if a.huge_pages:
        print(*(line.strip() for line in open("/proc/self/smaps_rollup") if "AnonHuge" in line))
    ids = torch.arange(1, num_blocks) if a.order == "address" else torch.randperm(num_blocks - 1) + 1
    q = torch.randn(a.batch, H, D)
    steps = []
    for layer in range(a.layers):
        mine = ids[layer * a.batch * per:(layer + 1) * a.batch * per]
        seqs = [SeqAttention(i, 1, a.context, mine[i * per:(i + 1) * per]) for i in range(a.batch)]
        steps.append(AttentionMetadata(torch.zeros(a.batch, dtype=torch.int64), seqs).packed)
    gb = a.batch * a.context * HKV * D * 2 * 4 * a.layers / 1e9
    print(f"{a.batch} x {a.context} tokens, {a.layers} layers, {a.order} pages, "
          f"{torch.get_num_threads()} threads, {gb * 1e3 / a.layers:.1f} MB of KV a layer")
    for r in range(a.rounds):
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for si, tb in steps:
                op(q, k, v, si, tb, scale)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(f"round {r}: {t * 1e3:.2f} ms a step, {gb / t:.1f} GB/s of KV")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
