"""Quantized KV pages through the engine: sizes from the spec, correct results under
batching and preemption, prefix-cache keys that separate dtypes and scale granularities."""

from __future__ import annotations

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.kv_cache.storage import KVCacheStorage

QUANT = ["int8", "fp8_e4m3", "fp8_e5m2"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("gran", ["per-token-head", "per-head", "per-tensor", "per-channel"])
def test_storage_bytes_equal_spec(dtype, gran):
    spec = KVCacheSpec(3, 2, 16, dtype, 16, scale_granularity=gran)
    st = KVCacheStorage(spec, 7)
    assert st.nbytes == 7 * spec.page_size_bytes + spec.static_bytes


@pytest.mark.parametrize("dtype", QUANT)
def test_written_pages_dequantize_close_to_input(dtype):
    spec = KVCacheSpec(1, 2, 16, dtype, 4)
    st = KVCacheStorage(spec, 4)
    k, v = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    slots = torch.tensor([13, 2, 7, 0, 9, 4])
    st.write(0, slots, k, v)
    from pagedkv.attention.reference import gather_pages

    layer = st.layer(0)
    table = torch.arange(4)
    back = gather_pages(layer.k, table, 16, layer.k_scale)[slots]
    tol = {"int8": 0.01, "fp8_e4m3": 0.07, "fp8_e5m2": 0.13}[dtype]
    assert ((back - k).abs() <= tol * k.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("dtype", QUANT)
def test_quantized_engine_batch_and_preemption_match_solo(tiny_llm_factory, dtype):
    prompts = [{"prompt_token_ids": list(range(100 + 40 * i, 117 + 40 * i + i))} for i in range(4)]
    solo = tiny_llm_factory(num_blocks=32, kv_cache_dtype=dtype)
    ref = [solo.generate([p], GREEDY)[0].token_ids for p in prompts]
    tight = tiny_llm_factory(num_blocks=5, kv_cache_dtype=dtype, max_num_batched_tokens=16)
    outs = tight.generate(prompts, GREEDY)
    assert tight.stats().num_preemptions > 0 and tight.stats().blocks_used == 0
    # per-token-head scales are row-local, so quantized results do not depend on batching
    assert [o.token_ids for o in outs] == ref


def test_prefix_key_separates_dtype_and_scale(tiny_llm_factory):
    a = tiny_llm_factory(num_blocks=8, kv_cache_dtype="int8").engine.kv_manager.extra_keys
    b = tiny_llm_factory(num_blocks=8, kv_cache_dtype="int8", kv_cache_scale="per-head").engine.kv_manager.extra_keys
    c = tiny_llm_factory(num_blocks=8, kv_cache_dtype="fp8_e4m3").engine.kv_manager.extra_keys
    assert len({a, b, c}) == 3
    assert dict(a)["kv_dtype"] == "int8" and dict(b)["kv_scale"] == "per-head"


@pytest.mark.parametrize("dtype", QUANT)
def test_kernel_and_reference_reads_agree_in_the_engine(tiny_llm_factory, monkeypatch, dtype):
    prompts = [{"prompt_token_ids": list(range(50 + 30 * i, 90 + 30 * i))} for i in range(3)]
    outs = {}
    for mode in ("kernel", "reference"):
        monkeypatch.setenv("PAGEDKV_ATTENTION", mode)
        llm = tiny_llm_factory(num_blocks=16, kv_cache_dtype=dtype)
        outs[mode] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs["kernel"] == outs["reference"]
