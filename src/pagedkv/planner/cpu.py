"""``--gpu cpu``: measure this machine's read bandwidth and fp32 matmul rate once, then cache them.

Method (torch, default threads): read bandwidth is the best of several ``x.sum()`` passes over
a float32 tensor much larger than the last-level cache (bytes read / seconds); copy bandwidth
the best of several copies of half of it (bytes copied / seconds: what moving KV pages between
pools in host memory runs at); the matmul rate is the best of several ``a @ b`` on square
float32 matrices (``2 n^3`` FLOPs / seconds). Best-of-N, because these machines are shared and
noise only ever slows a run down. Device memory is the machine's physical RAM.

The result is cached as JSON in ``$XDG_CACHE_HOME/pagedkv/cpu.json`` (else
``~/.cache/pagedkv/cpu.json``), keyed by host name, CPU count and torch thread
count; delete the file to measure again. :func:`pagedkv.planner.hardware.get_device`
turns the measurement into a ``Device`` (this module knows nothing of devices, so the
catalog can depend on it and not the other way round).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

READ_BYTES = 512 * 2**20   # 512 MiB: well past any CPU's last-level cache
MATMUL_N = 1024
REPEATS = 5


def cache_path() -> Path:
    """Where the measurement is cached."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedkv" / "cpu.json"


def _machine_key() -> str:
    import torch
    return f"{platform.node()}|cpus={os.cpu_count()}|threads={torch.get_num_threads()}"


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(read_bytes: int | None = None, matmul_n: int | None = None, repeats: int | None = None) -> dict:
    """Measure now: ``{"read_bandwidth_bytes_per_s", "fp32_flops", "memory_bytes", ...}``.

    Sizes default to the module's ``READ_BYTES``, ``MATMUL_N`` and ``REPEATS``.
    """
    import torch
    read_bytes, matmul_n, repeats = read_bytes or READ_BYTES, matmul_n or MATMUL_N, repeats or REPEATS
    x = torch.ones(read_bytes // 4, dtype=torch.float32)       # [read_bytes / 4]
    bw = read_bytes / _best_seconds(lambda: x.sum(), repeats)
    half = x[: x.numel() // 2]
    dst = torch.empty_like(half)
    copy = half.numel() * 4 / _best_seconds(lambda: dst.copy_(half), repeats)  # bytes copied / s
    x = half = dst = None  # freed (the timed lambdas are done with them)
    a = torch.randn(matmul_n, matmul_n)                         # [n, n]
    b = torch.randn(matmul_n, matmul_n)
    flops = 2 * matmul_n**3 / _best_seconds(lambda: a @ b, repeats)
    return {"key": _machine_key(), "read_bandwidth_bytes_per_s": bw, "copy_bandwidth_bytes_per_s": copy,
            "fp32_flops": flops,
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "method": f"best of {repeats}: sum over {read_bytes} B float32; copy of half of it; "
                      f"{matmul_n}^3 fp32 matmul",
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def page_copy_bandwidth(chunk_bytes: int, pool_bytes: int | None = None, copy_bytes: int = 12 * 2**20,
                        repeats: int = 9) -> float:
    """Bytes/s of copying ``chunk_bytes`` pieces scattered over a ``pool_bytes`` buffer (default
    ``READ_BYTES``: past the last-level cache) into one buffer, ``copy_bytes`` per copy
    (``torch.index_select``: one pass, torch's threads); the best of ``repeats`` copies,
    each of fresh random pieces (a repeat of the same pieces would read them from cache;
    best, not median, because on a shared machine other work only ever slows a copy down).

    A KV page is one such piece per layer for K and for V, so this is the rate the CPU KV
    tier's page copies run at; it falls with the piece size (here: about 12 GB/s at 4 KiB,
    17 at 12 KiB, 25 at 32 KiB, against 18-37 GB/s for one streaming copy), which is why
    the planner measures it at the model's own piece size. Not cached (well under a second).

    Raises:
        ValueError: ``chunk_bytes`` under 1 or over ``copy_bytes``.
    """
    import torch
    if not 0 < chunk_bytes <= copy_bytes:
        raise ValueError(f"a page piece of {chunk_bytes} bytes cannot be measured with {copy_bytes}-byte copies")
    size, dtype = (4, torch.float32) if chunk_bytes % 4 == 0 else (1, torch.uint8)
    row = chunk_bytes // size
    pool = torch.ones((pool_bytes or READ_BYTES) // chunk_bytes, row, dtype=dtype)
    n = copy_bytes // chunk_bytes
    dst = torch.empty(n, row, dtype=dtype)
    rates = []
    for _ in range(repeats):
        idx = torch.randperm(pool.shape[0])[:n]
        t = time.perf_counter()
        torch.index_select(pool, 0, idx, out=dst)
        rates.append(n * chunk_bytes / (time.perf_counter() - t))
    return max(rates)


def load_or_measure(path: Path | None = None, fresh: bool = False, save: bool = True) -> dict:
    """The cached measurement for this machine, measuring (and, with ``save``, caching) if
    absent or stale, or (``fresh``) in any case: a cache taken while the machine was busy
    stays low for good."""
    path = path or cache_path()
    try:
        cached = json.loads(path.read_text())
        if not fresh and cached.get("key") == _machine_key() and "copy_bandwidth_bytes_per_s" in cached:
            return cached
    except (OSError, ValueError, AttributeError):  # unreadable, or not this file's shape: measure
        pass
    result = measure()
    if not save:
        return result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    except OSError:
        pass  # a read-only home still gets a plan, just not a cache
    return result

