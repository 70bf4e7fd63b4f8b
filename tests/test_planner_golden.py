"""The seed's worked example (issue 3, point 6), with its errors corrected, and point 7."""

import pytest

from pagedkv.kv.spec import KVCacheSpec
from pagedkv.planner import get_device, plan
from pagedkv.planner.report import render
from pagedkv.planner.units import fmt_bytes

SEED = dict(model="llama-3-70b", kv_cache_dtype="float16", weight_dtype="float16", seq_len=4096, batch=32)


def test_llama3_70b_fp16_bytes_per_token():
    assert plan(**SEED).bytes_per_token == 327_680  # 80 layers x 8 KV heads x 128 x (K+V) x 2 B


def test_llama3_70b_request_and_batch_bytes_with_both_units():
    r = plan(**SEED)
    assert r.bytes_per_request == 1_342_177_280 == r.paged_bytes_per_request
    assert r.batch_bytes == 42_949_672_960
    assert fmt_bytes(r.bytes_per_request) == "1,342,177,280 B (1.34 GB, 1.25 GiB)"
    assert fmt_bytes(r.batch_bytes) == "42,949,672,960 B (42.9 GB, 40.0 GiB)"


def test_a100_bandwidths_and_no_sxm5():
    assert get_device("a100-80gb-sxm4").bandwidth == 2_039e9
    assert get_device("a100-40gb").bandwidth == 1_555e9
    with pytest.raises(ValueError, match="no A100 SXM5"):
        get_device("a100-sxm5")


def test_fp16_70b_weights_do_not_fit_one_a100_but_fit_tp2():
    one = plan(**SEED, gpu="a100-80gb-sxm4")
    assert 140e9 < one.weight_bytes < 142e9
    assert one.weights_fit is False and one.min_tp_for_weights == 2
    assert any("weights do not fit" in n and "--tp 2" in n for n in one.notes)
    two = plan(**{**SEED, "tp": 2}, gpu="a100-80gb-sxm4")
    assert two.weights_fit is True and two.num_blocks > 0
    assert two.batch_fits is False and two.min_tp_for_batch == 4  # 32 x 4k requests need 4 devices


def test_mha_variant_is_8x_not_2x():
    gqa, mha = plan(**SEED), plan(**SEED, kv_heads=64)
    assert mha.bytes_per_token == 2_621_440 == 8 * gqa.bytes_per_token
    assert mha.attention == "MHA"
    assert any("2,621,440 B/token, 8x" in n for n in gqa.notes)


def test_pcie_gen4_is_about_32_gbps_and_64x_slower_than_a100_hbm():
    a100 = get_device("a100-80gb-sxm4")
    assert a100.pcie_gen == 4 and 31e9 < a100.host_link < 32.1e9
    assert 63 < a100.bandwidth / a100.host_link < 66
    assert "64.7x slower than device memory" in render(plan(**{**SEED, "tp": 2}, gpu="a100-80gb-sxm4"))


def test_deepseek_v3_mla_bf16_bytes_per_token():
    assert plan("deepseek-v3", kv_cache_dtype="bfloat16").bytes_per_token == 70_272  # 61 x (512 + 64) x 2


def test_num_blocks_equals_engine_sizing():
    """Point 7: the engine's pool for 256 MiB on smollm2 (fp32 on CPU, 30 x 3 x 64) is the plan's."""
    budget = 256 * 2**20
    engine = KVCacheSpec(30, 3, 64, dtype="float32", block_size=16).num_blocks_for(budget)
    r = plan("smollm2-135m-instruct", kv_cache_memory="256MiB", block_size=16)
    assert r.num_blocks == engine == 363  # 364 pages fit; page 0 is the null page
    assert r.kv_cache_dtype == "float32" and r.cache_budget_bytes == budget
    assert plan("smollm2-135m-instruct", kv_cache_memory="256MiB", block_size=32).num_blocks == \
        KVCacheSpec(30, 3, 64, dtype="float32", block_size=32).num_blocks_for(budget)
