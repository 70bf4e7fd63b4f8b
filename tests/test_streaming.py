"""StreamingLLM eviction (issue 14, ``--kv-eviction streaming``): attention sinks plus a
recent window for any model, the pages in between given back (positions: test_streaming_positions.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pagedkv import EngineConfig, SamplingParams

PROMPT = {"prompt_token_ids": torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(1)).tolist()}
STREAM = dict(kv_eviction="streaming", kv_window_tokens=10, num_sink_tokens=2, block_size=4)


def greedy(llm, n=40, prompt=PROMPT):
    return llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1))[0]


def test_a_window_past_the_whole_sequence_changes_nothing(tiny_llm_factory):
    """The issue's budget-at-or-above-the-context check: bit-identical tokens and log-probs."""
    plain = greedy(tiny_llm_factory(num_blocks=64, block_size=4))
    wide = greedy(tiny_llm_factory(num_blocks=64, block_size=4, kv_eviction="streaming", kv_window_tokens=70,
                                   num_sink_tokens=4))
    assert wide.token_ids == plain.token_ids and wide.logprobs == plain.logprobs


def test_sinks_and_window_change_long_outputs_and_the_kernel_agrees_with_the_reference(tiny_llm_factory,
                                                                                       monkeypatch):
    plain = greedy(tiny_llm_factory(num_blocks=64, block_size=4))
    kernel = greedy(tiny_llm_factory(num_blocks=64, **STREAM))
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    reference = greedy(tiny_llm_factory(num_blocks=64, **STREAM))
    assert kernel.token_ids == reference.token_ids
    assert max(abs(a - b) for x, y in zip(kernel.logprobs, reference.logprobs)
               for a, b in zip(x.values(), y.values())) < 1e-4
    assert kernel.token_ids != plain.token_ids  # 70 tokens, a 10-token window: the output differs


def test_pages_between_sinks_and_window_go_back_the_sinks_stay(tiny_llm_factory):
    from pagedkv.kv.single_type import SlidingWindowManager

    llm = tiny_llm_factory(num_blocks=64, enable_prefix_caching=False, max_num_batched_tokens=16, **STREAM)
    eng = llm.engine
    mgr = eng.kv_manager.groups[0]
    assert isinstance(mgr, SlidingWindowManager) and mgr.sink_blocks == 1
    assert eng.max_model_len == 512  # the model positions by default (16-token chunks bound the pages)
    eng.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), request_id="r")
    eng.step()  # the prefill's two 16-token chunks hold the prompt's pages while they compute it
    eng.step()
    held = []
    while eng.has_unfinished_requests():
        eng.step()
        table = mgr.block_tables.get("r", [])
        if table:
            assert table[0] != eng.kv_manager.pool.null_block  # the sink page
            held.append(sum(b != eng.kv_manager.pool.null_block for b in table))
    assert max(held) == 1 + -(-10 // 4) + 1 and mgr.blocks_given_back > 10
    assert eng.kv_manager.usage().used == 0


def test_a_repeated_prompt_hits_with_its_sink_pages(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=64, **STREAM)
    first, second = greedy(llm, 8), greedy(llm, 8)
    assert second.num_cached_tokens >= 12 and second.token_ids == first.token_ids


def test_streaming_settings_are_checked():
    with pytest.raises(ValueError, match="kv_window_tokens"):
        EngineConfig(kv_eviction="streaming")
    with pytest.raises(ValueError, match="num_sink_tokens"):
        EngineConfig(kv_eviction="streaming", kv_window_tokens=8, num_sink_tokens=-1)
    with pytest.raises(ValueError, match="kv_eviction must be one of"):
        EngineConfig(kv_eviction="tova")
    for stray in (dict(kv_window_tokens=64), dict(num_sink_tokens=8)):  # would silently do nothing
        with pytest.raises(ValueError, match="apply to kv_eviction streaming"):
            EngineConfig(**stray)
    assert EngineConfig(kv_eviction="streaming", kv_window_tokens=8).num_sink_tokens == 4


def test_streaming_is_a_cli_flag(tiny_model_dir):
    run = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(tiny_model_dir), "--num-blocks", "32",
           "--block-size", "4", "--max-tokens", "30", "--no-chat", "--json", "--ignore-eos", "--kv-eviction",
           "streaming", "--kv-window-tokens", "8", "--num-sink-tokens", "2", "hello there"]
    r = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[0])["token_ids"]) == 30
