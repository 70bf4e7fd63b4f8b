"""Prompt logprobs (the basis of ``pagedkv eval ppl``) equal HF's, whatever the chunking,
and the perplexity arithmetic and CLI work end to end on a tiny model."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.eval.ppl import perplexity, rolling_windows, windows

IDS = list(range(300, 341))  # 41 tokens: crosses two block boundaries


def test_prompt_logprobs_match_hf_and_chunking(tiny_llm_factory, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    whole = tiny_llm_factory(num_blocks=16).generate([{"prompt_token_ids": IDS}], params)[0].prompt_logprobs
    chunked = tiny_llm_factory(num_blocks=16, max_num_batched_tokens=7).generate(
        [{"prompt_token_ids": IDS}], params)[0].prompt_logprobs
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([IDS])).logits[0], -1)
    ref = [lp[i - 1, IDS[i]].item() for i in range(1, len(IDS))]
    assert whole[0] is None and len(whole) == len(IDS)
    assert max(abs(a - b) for a, b in zip(whole[1:], ref)) < 1e-4
    assert chunked == whole


def test_prompt_top_logprobs_are_hfs_top_k(tiny_llm_factory, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    out = tiny_llm_factory(num_blocks=16, max_num_batched_tokens=9).generate([{"prompt_token_ids": IDS}], params)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([IDS])).logits[0], -1)
    assert out.prompt_top_logprobs[0] is None and len(out.prompt_top_logprobs) == len(IDS)
    for pos in range(1, len(IDS)):
        top = torch.topk(lp[pos - 1], 3)
        got = out.prompt_top_logprobs[pos]
        assert list(got) == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(got.values(), top.values.tolist())) < 1e-4
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    assert SamplingParams(prompt_logprobs=0) and tiny_llm_factory(num_blocks=16).generate(
        [{"prompt_token_ids": IDS}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_top_logprobs is None


def test_prompt_logprobs_skip_prefix_hits(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=16)
    llm.generate([{"prompt_token_ids": IDS}], SamplingParams(max_tokens=1))
    out = llm.generate([{"prompt_token_ids": IDS}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0 and all(v is not None for v in out.prompt_logprobs[1:])


def test_windows_and_perplexity_arithmetic(tiny_llm_factory):
    assert windows(list(range(10)), 9, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail is dropped
    assert windows(list(range(10)), 10, 4)[-1] == [8, 9]
    with pytest.raises(ValueError):
        windows([1, 2, 3], 3, 1)
    llm = tiny_llm_factory(num_blocks=16)
    r = perplexity(llm, IDS, 40, 20)
    outs = llm.generate([{"prompt_token_ids": IDS[:20]}, {"prompt_token_ids": IDS[20:40]}],
                        SamplingParams(max_tokens=1, prompt_logprobs=0))
    lps = [v for o in outs for v in o.prompt_logprobs[1:]]
    assert r.num_scored_tokens == 38 and r.num_windows == 2
    assert math.isclose(r.ppl, math.exp(-sum(lps) / len(lps)), rel_tol=1e-9)


def test_eval_ppl_cli_compares_dtypes(tiny_model_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The cache holds keys and values. " * 30)
    r = subprocess.run([sys.executable, "-m", "pagedkv.cli", "eval", "ppl", "--model", str(tiny_model_dir),
                        "--file", str(text), "--num-tokens", "64", "--window", "32", "--num-blocks", "16",
                        "--kv-cache-dtype", "float32,float16", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    import json

    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["kv_cache_dtype"] for x in rows] == ["float32", "float16"]
    assert rows[0]["ppl_vs_first"] == 1.0 and abs(rows[1]["ppl_vs_first"] - 1) < 0.01


def test_eval_ppl_cli_by_position_on_the_bundled_text_past_the_models_positions(tiny_model_dir):
    """No --file: the bundled Monte Cristo chapters; streaming runs one 600-token window on a
    model of 512 positions."""
    r = subprocess.run([sys.executable, "-m", "pagedkv.cli", "eval", "ppl", "--model", str(tiny_model_dir),
                        "--num-tokens", "600", "--window", "600", "--num-blocks", "64", "--by-position", "200",
                        "--kv-cache-dtype", "float32", "--kv-eviction", "streaming", "--kv-window-tokens", "60",
                        "--block-size", "4", "--max-num-batched-tokens", "64"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "599 tokens in 1 windows" in r.stdout and "positions     400-599" in r.stdout


# lm-eval 0.4.13's requests for ten tokens 100..109 with prefix token 1 and model_args
# max_length = window + 1 (TemplateAPI keeps max_length - 1 tokens for the prompt; printed
# from lm_eval.utils.get_rolling_token_windows + make_disjoint_window and TemplateAPI's
# truncation), as (token ids, ctxlen): lm-eval scores token_logprobs[ctxlen:-1].
LM_EVAL_ROLLING = {
    4: [([1, 100, 101, 102], 1), ([102, 103, 104, 105], 1), ([105, 106, 107, 108], 1), ([106, 107, 108, 109], 3)],
    5: [([1, 100, 101, 102, 103], 1), ([103, 104, 105, 106, 107], 1), ([105, 106, 107, 108, 109], 3)],
}


@pytest.mark.parametrize("window", sorted(LM_EVAL_ROLLING))
def test_rolling_windows_are_lm_evals(window):
    got = [(w.token_ids, w.first_scored) for w in rolling_windows(list(range(100, 110)), 100, window, 1)]
    assert got == LM_EVAL_ROLLING[window]


@pytest.mark.parametrize("n,window", [(1, 4), (3, 4), (9, 4), (40, 7), (41, 41), (12, 2)])
def test_rolling_windows_score_every_token_once(n, window):
    ids = list(range(500, 500 + n))
    wins = rolling_windows(ids, n, window, 7)
    scored = [t for w in wins for t in w.token_ids[w.first_scored:]]
    assert scored == ids and all(len(w.token_ids) <= window for w in wins)
    assert wins[0].token_ids[0] == 7
    offsets = [w.offset + i for w in wins for i in range(w.first_scored, len(w.token_ids))]
    assert offsets == list(range(n))  # each scored token at its place in the text


def test_position_buckets_group_tokens_by_place_in_the_text():
    from pagedkv.eval.ppl import Window, position_buckets

    wins = [Window([0] * 4, offset=0), Window([0] * 4, offset=4)]  # scores text positions 1-3 and 5-7
    logps = [[-1.0, -1.0, -3.0], [-2.0, -2.0, -2.0]]
    got = position_buckets(wins, logps, 4)
    assert [(b.start, b.end, b.num_scored_tokens) for b in got] == [(0, 4, 3), (4, 8, 3)]
    assert math.isclose(got[0].ppl, math.exp(5 / 3)) and math.isclose(got[1].ppl, math.exp(2))


def test_perplexity_by_position_matches_the_whole(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=16)
    r = perplexity(llm, IDS, 40, 20, bucket=8)
    assert [b.start for b in r.by_position] == [0, 8, 16, 24, 32]
    assert sum(b.num_scored_tokens for b in r.by_position) == r.num_scored_tokens == 38
    nll = sum(math.log(b.ppl) * b.num_scored_tokens for b in r.by_position) / r.num_scored_tokens
    assert math.isclose(nll, r.nll, rel_tol=1e-9)


def test_rolling_perplexity_scores_all_tokens(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=16)
    r = perplexity(llm, IDS, 41, 16, rolling=True, prefix_token_id=1)
    assert r.num_scored_tokens == 41 and r.num_windows == 3
    with pytest.raises(ValueError, match="prefix token"):
        perplexity(llm, IDS, 41, 16, rolling=True)
