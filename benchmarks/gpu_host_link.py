"""Host <-> GPU copy rates by piece size, and the card's memory as CUDA reports it.

What the planner's offload and transfer figures assume about a GPU's host link (the
catalog's PCIe generation, ``planner/data/gpus.json``) measured on a real one: pinned and
pageable host buffers, host-to-device and device-to-host, one copy of each piece size
(64 KiB, a KV page of one layer, up to 256 MiB) at a time, medians of ``--repeats``, timed
with CUDA events. Also ``torch.cuda.mem_get_info`` after CUDA starts (total and free
bytes) beside the catalog's figure. torch only (runs on a bare GPU machine).

    python3 benchmarks/gpu_host_link.py --output host_link.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Median seconds of ``dst.copy_(src)`` (asynchronous where the host side is pinned)."""
    out = []
    for _ in range(repeats + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out[2:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--output", required=True)
    a = p.parse_args()
    free, total = torch.cuda.mem_get_info()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mem_get_info": {"free": free, "total": total},
              "copies": []}
    dev = torch.empty(max(SIZES), dtype=torch.uint8, device="cuda")
    hosts = {"pinned": torch.empty(max(SIZES), dtype=torch.uint8, pin_memory=True),
             "pageable": torch.empty(max(SIZES), dtype=torch.uint8)}
    for h in hosts.values():
        h.fill_(1)
    for kind, host in hosts.items():
        for n in SIZES:
            for direction, (dst, src) in (("h2d", (dev[:n], host[:n])), ("d2h", (host[:n], dev[:n]))):
                s = copy_seconds(dst, src, a.repeats)
                result["copies"].append({"host": kind, "direction": direction, "bytes": n, "seconds": s,
                                         "bytes_per_s": n / s})
                print(f"{kind:8s} {direction} {n >> 10:8d} KiB  {n / s / 1e9:7.2f} GB/s", flush=True)
    with open(a.output, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
