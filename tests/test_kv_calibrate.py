"""Static KV scales are calibrated at engine start on a fixed text, so they do not depend on
which request comes first (a 1-token first request used to fix scales that clipped later
keys) and quantized per-head / per-tensor runs are batch-invariant."""

from __future__ import annotations

import pytest
import torch

from pagedkv import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(200 + 37 * i, 230 + 41 * i))} for i in range(4)]


@pytest.mark.parametrize("gran", ["per-head", "per-tensor", "per-channel"])
def test_scales_are_set_at_start_and_do_not_follow_requests(tiny_llm_factory, gran):
    llm = tiny_llm_factory(num_blocks=32, kv_cache_dtype="int8", kv_cache_scale=gran)
    storage = llm.engine.parts.kv_cache
    before = [s.clone() for s in storage.k_scale]
    assert all((s > 0).all() and not torch.equal(s, torch.ones_like(s)) for s in before)  # calibrated
    llm.generate([{"prompt_token_ids": [5]}], GREEDY)                   # a 1-token first request
    assert all(torch.equal(a, b) for a, b in zip(before, storage.k_scale))
    again = tiny_llm_factory(num_blocks=6, kv_cache_dtype="int8", kv_cache_scale=gran).engine.parts.kv_cache
    assert all(torch.equal(a, b) for a, b in zip(before, again.k_scale))  # every run, every cache size


@pytest.mark.parametrize("gran", ["per-head", "per-tensor", "per-channel"])
def test_static_scale_outputs_do_not_depend_on_the_first_request_or_batch(tiny_llm_factory, gran):
    solo = []
    for p in PROMPTS:  # a fresh engine per prompt: each prompt is its engine's first request
        llm = tiny_llm_factory(num_blocks=32, kv_cache_dtype="fp8_e4m3", kv_cache_scale=gran)
        solo.append(llm.generate([p], GREEDY)[0].token_ids)
    llm = tiny_llm_factory(num_blocks=32, kv_cache_dtype="fp8_e4m3", kv_cache_scale=gran)
    llm.generate([{"prompt_token_ids": [7]}], GREEDY)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == solo


def test_set_static_scales_refuses_token_scales(tiny_llm_factory):
    storage = tiny_llm_factory(num_blocks=8, kv_cache_dtype="int8").engine.parts.kv_cache
    with pytest.raises(ValueError, match="no static scales"):
        storage.set_static_scales(0, torch.ones(2, 2, 16), torch.ones(2, 2, 16))


def test_eval_uses_the_engines_calibration(tiny_llm_factory):
    """attn-error computes static scales from the same text as the engine, whatever its window."""
    from pagedkv.kv_cache import quant
    from pagedkv.model.load import engine_calibration_ids
    from pagedkv.worker.kv_scales import layer_kv

    llm = tiny_llm_factory(num_blocks=8, kv_cache_dtype="int8", kv_cache_scale="per-channel", max_model_len=64)
    parts = llm.engine.parts
    cal = layer_kv(parts.model, engine_calibration_ids(llm.get_tokenizer(), parts.files.config))
    for i, (k, _) in enumerate(cal):
        assert torch.equal(quant.compute_scales(k, "int8", "per-channel"), parts.kv_cache.k_scale[i])


def test_reference_refuses_misshapen_scales():
    from pagedkv.attention.reference import gather_pages

    cache = torch.zeros(4, 16, 2, 8, dtype=torch.int8)
    table = torch.tensor([1, 0])
    for bad in (torch.ones(2, 8, 1), torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, 2), torch.ones(()),
                torch.ones(2, dtype=torch.float16)):
        with pytest.raises(ValueError, match="none of"):
            gather_pages(cache, table, 20, bad)
    assert gather_pages(cache, table, 20, torch.ones(2, 8)).shape == (20, 2, 8)
