"""Greedy outputs are bit-identical whatever the batching: batch size 1 vs N, forced
preemption (a pool of a few blocks), chunked prefill and prefix hits, for prompt lengths
1, 15, 16, 17, 32 and 33 at block size 16, on the real default model (fp32)."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams

LENGTHS = [1, 15, 16, 17, 32, 33]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm):
    text = ("Paged attention splits the key value cache into blocks of sixteen tokens each, "
            "so that requests of any length waste at most one partly filled block. ") * 2
    ids = smollm.get_tokenizer()(text).input_ids
    return [{"prompt_token_ids": ids[:n]} for n in LENGTHS]


@pytest.fixture(scope="module")
def solo(smollm, prompts):
    smollm.reset_prefix_cache()
    outs = []
    for p in prompts:
        outs.append(smollm.generate([p], GREEDY)[0].token_ids)
        smollm.reset_prefix_cache()
    return outs


def assert_same(outs, solo):
    for n, o, ref in zip(LENGTHS, outs, solo):
        assert o.token_ids == ref, f"prompt length {n}: {o.token_ids} != {ref}"
        assert o.finish_reason == "length" and len(o.token_ids) == GREEDY.max_tokens


@pytest.mark.slow
def test_batch_matches_solo(smollm, prompts, solo):
    smollm.reset_prefix_cache()
    assert_same(smollm.generate(prompts, GREEDY), solo)
    assert smollm.stats().blocks_used == 0


@pytest.mark.slow
def test_preemption_and_chunked_prefill_match_solo(prompts, solo):
    # 8 blocks of 16 = 128 slots for 6 requests needing up to 53 tokens each: forced preemption;
    # 24-token step budget: prompts are prefilled in chunks beside running decodes.
    llm = LLM(num_blocks=8, max_num_batched_tokens=24, enable_prefix_caching=False, debug_invariants=True)
    outs = llm.generate(prompts, GREEDY)
    assert llm.stats().num_preemptions > 0
    assert_same(outs, solo)
    assert llm.stats().blocks_used == 0 and llm.stats().blocks_free == 8


@pytest.mark.slow
def test_prefix_hits_match_cold(smollm, prompts, solo):
    smollm.reset_prefix_cache()
    smollm.generate(prompts, GREEDY)          # warm the cache
    outs = smollm.generate(prompts, GREEDY)   # every prompt now hits its full blocks
    for n, o in zip(LENGTHS, outs):
        assert o.num_cached_tokens == (n - 1) // 16 * 16
    assert_same(outs, solo)


@pytest.mark.slow
def test_batch_of_16_logprobs_match_solo_bit_for_bit(smollm):
    """Batch 1 vs 16 on the real model: token ids and every log-prob equal (each decode step
    of the batch is one 16-row product; alone, a 1-row product padded to 16)."""
    text = "Continuous batching lets sixteen requests share every decode step of the model. " * 3
    ids = smollm.get_tokenizer()(text).input_ids
    prompts = [{"prompt_token_ids": ids[:n]} for n in range(3, 51, 3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    smollm.reset_prefix_cache()
    solo = []
    for p in prompts:
        solo.append(smollm.generate([p], params)[0])
        smollm.reset_prefix_cache()
    batch = smollm.generate(prompts, params)
    assert len(prompts) == 16
    for s, b in zip(solo, batch):
        assert (b.token_ids, b.logprobs) == (s.token_ids, s.logprobs)
