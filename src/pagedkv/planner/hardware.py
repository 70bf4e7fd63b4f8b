"""The accelerator catalog: ``planner/data/gpus.json``, one datasheet source per entry.

Each entry gives device memory, peak memory bandwidth, dense FP16/BF16 and FP8
tensor rates, the host link (PCIe generation, x16) and the GPU-to-GPU link. The
file's ``conventions`` block states the units; ``pcie`` converts a generation to
one-direction GB/s (PCI-SIG: GT/s x 16 lanes x 128/130 / 8); ``storage.nvme`` is
the NVMe read rate used for "load a request's cache from disk".

``cpu`` is not in the file: :func:`get_device` measures this machine instead
(:mod:`pagedkv.planner.cpu`).

Units on :class:`Device`: bytes, bytes/s and FLOP/s (not GB or TFLOP/s).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

GIB = 2**30


@dataclass(frozen=True)
class Device:
    """One accelerator (or this CPU), in base units.

    Attributes:
        name: catalog key, e.g. ``"h100-sxm"``.
        label: marketing name.
        memory_bytes: device memory in bytes (datasheet GB read as GiB; see gpus.json).
        bandwidth: peak memory read bandwidth, bytes/s.
        flops_16: dense FP16/BF16 matrix rate, FLOP/s (for ``cpu``: the measured fp32 rate).
        flops_fp8: dense FP8 matrix rate, FLOP/s, or ``None`` without FP8 units.
        host_link: one-direction host link, bytes/s, or ``None`` (the cache already is in host memory).
        pcie_gen: PCIe generation of the host link, or ``None``.
        nvlink: GPU-to-GPU bandwidth (bidirectional total), bytes/s, or ``None``.
        source: where the numbers come from.
    """
    name: str
    label: str
    memory_bytes: int
    bandwidth: float
    flops_16: float
    flops_fp8: float | None
    host_link: float | None
    pcie_gen: int | None
    nvlink: float | None
    source: str
    copy_bandwidth: float | None = None  # host memory to host memory, bytes copied/s (cpu: measured)

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    @property
    def tp_link(self) -> float:
        """Bytes/s one device sends (and receives) in a tensor-parallel all-reduce: half the
        GPU link's bidirectional total, else the one-way host link (PCIe), else (a CPU: ranks
        share memory) the read bandwidth."""
        return self.nvlink / 2 if self.nvlink else self.host_link or self.bandwidth

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element as the engines move them: 2 on GPUs (fp16/bf16),
        4 on a CPU (pagedkv computes in fp32 there)."""
        return 4 if self.is_cpu else 2

    def matmul_rate(self, weight_dtype: str) -> float:
        """FLOP/s for matrix products with ``weight_dtype`` weights: FP8 units for fp8 weights
        where present, else the 16-bit rate (int8/int4 weights are dequantized to 16 bits)."""
        if weight_dtype.startswith("fp8") and self.flops_fp8:
            return self.flops_fp8
        return self.flops_16


@lru_cache(maxsize=1)
def catalog_data() -> dict:
    """The parsed gpus.json."""
    return json.loads(resources.files("pagedkv.planner").joinpath("data/gpus.json").read_text())


def _device(entry: dict, pcie: dict) -> Device:
    gen = entry.get("pcie_gen")
    nv = entry.get("nvlink_gbps")
    fp8 = entry.get("fp8_tflops")
    return Device(
        name=entry["name"], label=entry["label"], memory_bytes=int(entry["memory_gib"] * GIB),
        bandwidth=entry["memory_bandwidth_gbps"] * 1e9, flops_16=entry["fp16_tflops"] * 1e12,
        flops_fp8=fp8 * 1e12 if fp8 else None, host_link=pcie[str(gen)] * 1e9 if gen else None,
        pcie_gen=gen, nvlink=nv * 1e9 if nv else None, source=entry["source"])


def gpus() -> list[Device]:
    """Every catalog device, in file order."""
    data = catalog_data()
    return [_device(e, data["pcie"]) for e in data["gpus"]]


def gpu_names() -> list[str]:
    return [e["name"] for e in catalog_data()["gpus"]]


def nvme_read_bandwidth() -> float:
    """Sequential NVMe read rate in bytes/s (gpus.json ``storage.nvme``)."""
    return catalog_data()["storage"]["nvme"]["read_gbps"] * 1e9


def nvme_write_bandwidth() -> float:
    """Sequential NVMe write rate in bytes/s (gpus.json ``storage.nvme``)."""
    return catalog_data()["storage"]["nvme"]["write_gbps"] * 1e9


def disk_block_load_seconds(page_bytes: int, link: float | None) -> float:
    """Seconds to bring one ``page_bytes`` page from the disk KV tier into the cache: an
    NVMe read, then ``link`` bytes/s into the device pages (the host link on a GPU, the page
    copy rate on the CPU: :func:`pagedkv.planner.plan.tier_link`). The planner and the
    simulator both use this."""
    return page_bytes / nvme_read_bandwidth() + (page_bytes / link if link else 0.0)


def cpu_device(fresh: bool = False, save: bool = True) -> Device:
    """This machine as a :class:`Device`, from :mod:`pagedkv.planner.cpu`'s measurement
    (measured once, then cached; ``fresh``: measured again now, and cached if ``save``):
    fp32 matmul rate, read bandwidth, physical RAM."""
    from pagedkv.planner.cpu import cache_path, load_or_measure

    m = load_or_measure(fresh=fresh, save=save)
    return Device(name="cpu", label=f"this machine ({os.cpu_count()} CPUs, measured)",
                  memory_bytes=int(m["memory_bytes"]), bandwidth=float(m["read_bandwidth_bytes_per_s"]),
                  flops_16=float(m["fp32_flops"]), flops_fp8=None, host_link=None, pcie_gen=None,
                  nvlink=None, source=f"measured {m['measured_at']} ({m['method']}); cached in {cache_path()}",
                  copy_bandwidth=float(m["copy_bandwidth_bytes_per_s"]))


def get_device(name: str) -> Device:
    """A catalog device by name or alias (case-insensitive), or ``"cpu"`` for this machine.

    Raises:
        ValueError: for an unknown name (listing the known ones), or a part that does not exist.
    """
    key = str(name).strip().lower()
    if key == "cpu":
        return cpu_device()
    data = catalog_data()
    if key in data["not_products"]:
        raise ValueError(f"unknown GPU {name!r}: {data['not_products'][key]}")
    for entry in data["gpus"]:
        if key == entry["name"] or key in entry["aliases"]:
            return _device(entry, data["pcie"])
    raise ValueError(f"unknown GPU {name!r}; choose cpu or one of {', '.join(gpu_names())} (see --list-gpus)")
