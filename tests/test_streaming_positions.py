"""Streaming eviction's positions (issue 14, ``--streaming-positions``): ``cache``
(StreamingLLM's positions within the cache, the default) scores the sinks as if the
window sat right after them, so sequences run past the model's positions; ``original``
keeps every token at its place in the text. Checked against HF transformers on a
one-layer model (where a token's logits depend on layer-0 keys alone, so the policy is
exactly "HF on the sinks + window, at these position ids") and against the pageless
reference forward on a deeper one."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import make_hf_folder

from pagedkv import SamplingParams

SINKS, WINDOW, POSITIONS = 4, 20, 64
STREAM = dict(kv_eviction="streaming", kv_window_tokens=WINDOW, num_sink_tokens=SINKS, block_size=4,
              num_blocks=64, max_num_batched_tokens=16, max_model_len=400)
PROMPT = torch.randint(0, 49152, (150,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory, default_model_files):
    return make_hf_folder(tmp_path_factory.mktemp("one-layer"), seed=4, tokenizer_from=default_model_files.folder,
                          num_hidden_layers=1, max_position_embeddings=POSITIONS)


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory, default_model_files):
    return make_hf_folder(tmp_path_factory.mktemp("two-layers"), seed=5, tokenizer_from=default_model_files.folder,
                          max_position_embeddings=POSITIONS)


def prompt_logprobs(folder, **kw) -> list[float]:
    from pagedkv import LLM

    llm = LLM(model=str(folder), debug_invariants=True, **(STREAM | kw))
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    return out.prompt_logprobs[1:]  # of PROMPT[1:]


def hf_logprob(model, p: int, positions: str) -> float:
    """HF's log-probability of PROMPT[p + 1] after the sinks and the window of position p."""
    first = max(SINKS, p - WINDOW + 1)
    ids = PROMPT[:SINKS] + PROMPT[first:p + 1]
    pos = list(range(len(ids))) if positions == "cache" else list(range(SINKS)) + list(range(first, p + 1))
    with torch.no_grad():
        logits = model(torch.tensor([ids]), position_ids=torch.tensor([pos])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)[PROMPT[p + 1]].item()


@pytest.mark.parametrize("positions", ["cache", "original"])
def test_one_layer_matches_hf_on_sinks_plus_window(one_layer, positions):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(one_layer)).float().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # original positions past the model's: warned
        ours = prompt_logprobs(one_layer, streaming_positions=positions)
    for p in (10, SINKS + WINDOW - 2, SINKS + WINDOW - 1, SINKS + WINDOW, 40, POSITIONS - 1, POSITIONS, 100, 148):
        assert math.isclose(ours[p], hf_logprob(hf, p, positions), abs_tol=2e-4), p


def test_the_policies_agree_until_the_window_leaves_the_sinks(one_layer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache, original = prompt_logprobs(one_layer), prompt_logprobs(one_layer, streaming_positions="original")
    edge = SINKS + WINDOW - 1  # the last position whose window still touches the sinks
    assert cache[:edge + 1] == original[:edge + 1]
    assert all(c != o for c, o in zip(cache[edge + 1:], original[edge + 1:]))


def test_deeper_model_kernel_matches_the_pageless_reference(two_layers):
    """Engine (kernel, 16-token chunks, pages freed as the window slides) vs the model's
    dense forward with the same positions policy, past the model's 64 positions."""
    from pagedkv import LLM

    llm = LLM(model=str(two_layers), **STREAM)
    ours = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    model = llm.engine.model
    assert model.streaming_cache_len == SINKS + WINDOW
    logp = torch.log_softmax(model.logits(model.dense_forward(PROMPT)).double(), -1)
    ref = logp[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])].tolist()
    assert max(abs(a - b) for a, b in zip(ours.prompt_logprobs[1:], ref)) < 2e-4
    assert llm.engine.kv_manager.usage().used == 0 and llm.engine.stats().blocks_freed_by_window > 0


def test_decode_runs_past_the_models_positions_in_bounded_pages(two_layers, monkeypatch):
    from pagedkv import LLM

    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(model=str(two_layers), debug_invariants=True, **STREAM)
    out = llm.generate([{"prompt_token_ids": PROMPT[:30]}], params)[0]
    assert len(out.token_ids) == 300  # to position 329 of a model with 64
    assert llm.engine.kv_manager.usage().used == 0
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    ref = LLM(model=str(two_layers), **STREAM).generate([{"prompt_token_ids": PROMPT[:30]}], params)[0]
    assert ref.token_ids == out.token_ids


def test_the_fused_layer_rotates_the_sink_queries_too(two_layers):
    """int8 weights take the one-call decoder layer: bit-identical to the per-op path."""
    from pagedkv import LLM

    llm = LLM(model=str(two_layers), weight_dtype="int8", **STREAM)
    assert llm.engine.model.fused_op(llm.engine.parts.kv_cache) is not None
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, logprobs=2)
    fused = llm.generate([{"prompt_token_ids": PROMPT[:60]}], params)[0]
    llm.engine.model.fused_layers = False
    llm.reset_prefix_cache()
    per_op = llm.generate([{"prompt_token_ids": PROMPT[:60]}], params)[0]
    assert (fused.token_ids, fused.logprobs) == (per_op.token_ids, per_op.logprobs)


def test_position_settings_are_checked(two_layers):
    from pagedkv import LLM, EngineConfig

    with pytest.raises(ValueError, match="streaming_positions must be one of"):
        EngineConfig(kv_eviction="streaming", kv_window_tokens=8, streaming_positions="shifted")
    with pytest.raises(ValueError, match="applies to kv_eviction streaming"):
        EngineConfig(streaming_positions="original")
    with pytest.raises(ValueError, match="contiguous allocator"):
        EngineConfig(kv_eviction="streaming", kv_window_tokens=8, kv_allocator="contiguous")
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        LLM(model=str(two_layers), **(STREAM | {"kv_window_tokens": 61}))
    with pytest.raises(ValueError, match="exceeds the model's limit of 64 tokens"):
        LLM(model=str(two_layers), max_model_len=65)
    with pytest.warns(RuntimeWarning, match="distances the model never saw"):
        LLM(model=str(two_layers), streaming_positions="original", **STREAM)
