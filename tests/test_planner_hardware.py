"""The GPU catalog (a source for every entry) and the measured, cached ``--gpu cpu``."""

import json

import pytest

from pagedkv.planner import cpu, plan
from pagedkv.planner.hardware import catalog_data, get_device, gpus

REQUIRED = {"a100-40gb", "a100-80gb-sxm4", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x", "l4", "l40s",
            "rtx-4090"}
NUMBERS = ("memory_gib", "memory_bandwidth_gbps", "fp16_tflops", "pcie_gen")


def test_catalog_has_required_gpus_with_sources_and_numbers():
    entries = {e["name"]: e for e in catalog_data()["gpus"]}
    assert REQUIRED <= set(entries)
    for e in entries.values():
        assert "http" in e["source"], e["name"]
        assert all(isinstance(e[k], (int, float)) and e[k] > 0 for k in NUMBERS), e["name"]
        assert e["fp8_tflops"] is None or e["fp8_tflops"] > e["fp16_tflops"]
    assert catalog_data()["pcie"]["source"] and catalog_data()["storage"]["nvme"]["source"]


def test_datasheet_figures():
    h100 = get_device("h100")  # alias
    assert h100.name == "h100-sxm" and h100.bandwidth == 3.35e12 and h100.memory_bytes == 80 * 2**30
    assert get_device("H200").bandwidth == 4.8e12 and get_device("mi300x").memory_bytes == 192 * 2**30
    assert get_device("l4").nvlink is None and get_device("b200").nvlink == 1.8e12
    assert all(d.host_link for d in gpus())


def test_unknown_gpu_lists_choices():
    with pytest.raises(ValueError, match="h100-sxm"):
        get_device("v100")


@pytest.fixture
def cache_home(tmp_path, monkeypatch, own_cpu_measurement):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu, "cache_path", own_cpu_measurement)  # the $XDG_CACHE_HOME lookup itself
    monkeypatch.setattr(cpu, "READ_BYTES", 8 * 2**20)
    monkeypatch.setattr(cpu, "MATMUL_N", 128)
    monkeypatch.setattr(cpu, "REPEATS", 2)
    return tmp_path


def test_cpu_is_measured_once_then_cached(cache_home, monkeypatch):
    first = get_device("cpu")
    path = cache_home / "pagedkv" / "cpu.json"
    assert path.is_file() and first.bandwidth > 1e8 and first.flops_16 > 1e8
    assert json.loads(path.read_text())["read_bandwidth_bytes_per_s"] == first.bandwidth

    def fail(*a, **k):
        raise AssertionError("measured again despite the cache")
    monkeypatch.setattr(cpu, "measure", fail)
    assert get_device("cpu") == first


def test_cpu_plan_uses_float32_and_gives_bounds(cache_home):
    r = plan("smollm2-135m-instruct", gpu="cpu", seq_len=512, batch=2)
    assert r.gpu == "cpu" and r.kv_cache_dtype == "float32" and r.weight_dtype == "float32"
    assert r.decode.seconds > 0 and r.host_link_seconds is None and r.num_blocks > 0
