"""``benchmarks/gpu_check.py``, the device check a session with a GPU runs first (issue 52),
kept runnable: its ``--quick`` mode on the CPU (tiny shapes, Triton interpreted) runs the
kernel, engine and tier sections and records no error, so the script a GPU session inherits works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_quick_runs_clean_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--out", str(tmp_path),
                        "--sections", "env", "ceilings", "kernels", "engine", "kernel_speed", "engine_speed", "tiers"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_check_quick.json").read_text())
    assert out["kernels"] and all(row["ok"] for row in out["kernels"])
    engine = out["engine"]["tiny"]
    for ref in ("fp32_eager_vs_hf", "fp32_eager_vs_cpu_engine"):
        assert engine[ref]["identical"] == engine[ref]["sequences"] > 0, ref
    assert engine["fp32_graphs_vs_eager_identical"] and engine["small_pool_chunked_same_tokens"]
    assert engine["prefix_cache_hit_tokens"] > 0 and engine["prefix_cache_same_tokens"]
    assert engine["bf16_vs_fp32_teacher_forced"]["positions"] > 0
    assert all(row["seconds"] > 0 for row in out["kernel_speed"])
    speed = out["engine_speed"]
    assert speed["single_stream_graphs"]["step_s"] > 0 and speed["batch4"]["output_tokens_per_s"] > 0
    assert speed["prefill"]["ttft_s"] > 0
    tiers = out["tiers"]  # the device tier worker on the float path (bf16 on CPU tensors)
    assert tiers["outputs"]["tier_vs_device_hit_identical"] == "3 of 3" and tiers["outputs"]["tier_hit_tokens"] > 0
    assert tiers["outputs"]["batch_invariant_tier_vs_recompute_identical"] == "3 of 3"
    assert tiers["outputs"]["swap"]["identical_sequences"] == 8 and tiers["outputs"]["swap"]["swap_outs"] > 0
    assert tiers["load_rate"]["block_load_bytes_per_s"] > 0 and tiers["decode_saves"]["blocks_saved"] > 0
    assert tiers["returning_turn"]["tier"] > 0
    assert tiers["swap_vs_recompute"]["swap"]["preemptions"]["swap"] > 0
    assert tiers["swap_vs_recompute"]["recompute"]["preemptions"]["recompute"] > 0
    assert "sections with errors: none" in (tmp_path / "gpu_check_quick.txt").read_text()
