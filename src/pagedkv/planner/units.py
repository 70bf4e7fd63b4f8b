"""Formatting of sizes, times and rates for the planner's text output.

Every size is printed in bytes and in both decimal and binary units, labelled:
GB = 1e9 bytes, GiB = 2^30 bytes (likewise MB/MiB, kB/KiB, TB/TiB).
"""

from __future__ import annotations

GB = 10**9
GIB = 2**30
_DEC = ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB"))
_BIN = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def _sig3(x: float) -> str:
    """Three significant digits, keeping trailing zeros: 40.0, 1.25, 328."""
    digits = 2 if abs(x) < 10 else 1 if abs(x) < 100 else 0
    return f"{x:,.{digits}f}"


def _scaled(n: float, table) -> str:
    binary = table is _BIN
    for size, unit in table:
        if abs(n) >= size * (1000 / 1024 if binary else 1):  # 1,023.7 MiB prints as 1.00 GiB
            return f"{_sig3(n / size)} {unit}"
    return f"{n:,.0f} B"


def fmt_bytes(n: float) -> str:
    """``1342177280`` -> ``"1,342,177,280 B (1.34 GB, 1.25 GiB)"``."""
    if abs(n) < 1000:
        return f"{n:,.0f} B"
    return f"{n:,.0f} B ({_scaled(n, _DEC)}, {_scaled(n, _BIN)})"


def fmt_short(n: float) -> str:
    """Compact decimal and binary: ``"1.34 GB / 1.25 GiB"``."""
    return f"{_scaled(n, _DEC)} / {_scaled(n, _BIN)}"


def fmt_seconds(s: float | None) -> str:
    """``0.0123`` -> ``"12.3 ms"``; ``None`` -> ``"n/a"``."""
    if s is None:
        return "n/a"
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "us")):
        if s >= scale:
            return f"{_sig3(s / scale)} {unit}"
    return f"{_sig3(s * 1e9)} ns"


def fmt_rate(bytes_per_s: float) -> str:
    """Bandwidth in GB/s (1e9 bytes/s)."""
    x = bytes_per_s / GB
    return f"{x:,.0f} GB/s" if x >= 100 else f"{x:,.1f} GB/s"


def fmt_flop_count(flops: float) -> str:
    """A FLOP count in TFLOP (1e12) or GFLOP (1e9): ``"2.40 TFLOP"``."""
    return f"{_sig3(flops / 1e12)} TFLOP" if flops >= 1e12 else f"{_sig3(flops / 1e9)} GFLOP"


def fmt_flops(flops_per_s: float) -> str:
    """A FLOP rate in TFLOP/s (1e12), or GFLOP/s below 1 TFLOP/s."""
    return fmt_flop_count(flops_per_s) + "/s"
