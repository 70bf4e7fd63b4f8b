"""One source of truth: ``pagedkv plan`` reports the num_blocks the engine allocates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedkv import LLM, plan


@pytest.mark.slow
@pytest.mark.parametrize("budget,block_size,dtype", [("256MiB", 16, "auto"), ("100MB", 32, "float16")])
def test_plan_num_blocks_equals_engine_pool(budget, block_size, dtype):
    llm = LLM(kv_cache_memory=budget, block_size=block_size, kv_cache_dtype=dtype)
    engine_blocks = llm.engine.kv_manager.pool.num_blocks
    # + null page
    assert llm.engine.parts.kv_cache.nbytes == (engine_blocks + 1) * llm.engine.parts.kv_spec.page_size_bytes
    result = plan(model="smollm2-135m-instruct", kv_cache_memory=budget, block_size=block_size,
                  kv_cache_dtype=dtype)
    assert result.num_blocks == engine_blocks
    assert result.bytes_per_token == llm.engine.parts.kv_spec.bytes_per_token


def test_plan_cli_json_num_blocks_256mib():
    out = subprocess.run([sys.executable, "-m", "pagedkv.cli", "plan", "--model", "smollm2-135m-instruct",
                          "--kv-cache-memory", "256MiB", "--block-size", "16", "--json"],
                         capture_output=True, text=True, check=True).stdout
    # 46,080 B/token x 16 = 737,280 B per block; 268,435,456 // 737,280 = 364
    assert json.loads(out)["num_blocks"] == 363  # 364 pages fit; page 0 is the null page


def test_hybrid_pages_only_where_the_engine_keeps_two_groups():
    """Gemma 2's window and full layers share pages (a page = half the layers: twice the
    pages); with a CPU tier or a draft model the engine keeps one group of whole-layer pages,
    and the plan says so."""
    kw = dict(model="gemma-2-9b", gpu="a100-80gb-sxm4", kv_cache_memory="8GiB")
    hybrid, tier = plan(**kw).num_blocks, plan(**kw, kv_offload_memory="10GiB").num_blocks
    assert abs(hybrid - 2 * tier) <= 1
    draft = plan(**kw, speculative_config={"model": "gemma-2-9b", "num_speculative_tokens": 2}).num_blocks
    assert abs(tier - 2 * draft) <= 1  # whole-layer pages holding both models' KV


@pytest.mark.parametrize("peak,non_torch,util", [(2 * 2**30, 600 * 2**20, 0.9), (123_456_789, 0, 0.5)])
def test_plan_with_activation_peak_equals_the_gpu_engines_sizing(tiny_llm_factory, tiny_model_dir, peak, non_torch,
                                                                  util):
    """The GPU engine sizes its pool from one profiling step (:mod:`pagedkv.worker.memory`);
    ``plan(activation_peak=peak + non_torch)`` on the same device and weights gives the same
    pages. The device is the planner's H100 entry; the step's figures are set, not measured."""
    from pagedkv.kv.spec import pool_num_blocks
    from pagedkv.planner.hardware import get_device
    from pagedkv.worker.memory import MemoryProfile

    result = plan(model=str(tiny_model_dir), gpu="h100-sxm", gpu_memory_utilization=util,
                  activation_peak=peak + non_torch)
    profile = MemoryProfile(get_device("h100-sxm").memory_bytes, result.weight_bytes, peak, non_torch)
    spec = tiny_llm_factory(dtype="bfloat16").engine.parts.kv_spec  # a GPU engine computes in bf16
    assert result.cache_budget_bytes == profile.kv_budget(util)
    assert result.num_blocks == pool_num_blocks((spec,), profile.kv_budget(util))
    assert result.num_blocks < plan(model=str(tiny_model_dir), gpu="h100-sxm", gpu_memory_utilization=util).num_blocks
