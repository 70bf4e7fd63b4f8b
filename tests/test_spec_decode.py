"""Speculative decoding with n-gram drafts (issue 13): greedy output token-identical (and
log-probs bit-identical, batch-invariant mode) to decoding without it, for k in {1, 2, 4, 8},
at prompt lengths whose drafts cross block edges, in a batch of mixed requests, under
preemption on a tiny pool; pages of rejected drafts go back at once and no page holding an
unverified position is ever hashed; rejection sampling samples the target's distribution."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.config.speculative import SpeculativeConfig
from pagedkv.core.sampling_params import SamplingParams as SP
from pagedkv.worker.spec_decode.ngram import AdaptiveGate, ngram_propose
from pagedkv.worker.spec_decode.verify import verify

LENGTHS = (15, 16, 17, 31, 32, 33)


def _prompt(n: int, seed: int = 0) -> list[int]:
    """A prompt that repeats a short phrase (so n-gram drafts find matches)."""
    phrase = [100 + seed, 200 + seed, 300 + seed, 400 + seed, 500 + seed, 600 + seed, 700 + seed]
    return (phrase * (n // len(phrase) + 1))[:n]


def _spec(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _generate(llm, prompts, max_tokens=24, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1, **kw)
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _check_pages(eng, k: int) -> None:
    """After every step: pool invariants; a running request holds no more pages than its
    committed tokens plus one step of drafts need; every published page holds committed tokens."""
    eng.kv_manager.check_invariants()
    bs = eng.kv_manager.block_size
    for req in eng.scheduler.running:
        table = eng.kv_manager.get_block_ids(req.request_id)[0]
        assert len(table) <= -(-(req.num_computed_tokens + 1 + k) // bs), (len(table), req.num_computed_tokens)
        group = eng.kv_manager.groups[0]
        published = group.num_published.get(req.request_id, 0)
        assert published * bs <= min(req.num_computed_tokens, req.num_tokens)


def _run_checked(llm, prompts, k: int, max_tokens=24):
    eng = llm.engine
    step = eng.step

    def checked_step():
        outs = step()
        _check_pages(eng, k)
        return outs
    eng.step = checked_step
    try:
        return _generate(llm, prompts, max_tokens)
    finally:
        del eng.step


@pytest.fixture(scope="module")
def reference(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True)
    prompts = [_prompt(n, i) for i, n in enumerate(LENGTHS)] + [list(range(900, 940))]  # the last: no repeats
    return prompts, _generate(llm, prompts)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_output_is_identical_in_a_mixed_batch(tiny_llm_factory, reference, k):
    prompts, want = reference
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, speculative_config=_spec(k))
    assert _run_checked(llm, prompts, k) == want
    s = llm.engine.stats().spec_decode
    assert s["num_draft_tokens"] > 0 and 0 < s["num_accepted_tokens"], s
    assert llm.engine.kv_manager.pool.num_used == 0


def test_speculation_under_preemption_on_a_tiny_pool_stays_identical(tiny_llm_factory, reference):
    prompts, want = reference
    llm = tiny_llm_factory(num_blocks=9, batch_invariant=True, speculative_config=_spec(4))
    assert _run_checked(llm, prompts, 4) == want
    assert llm.engine.stats().num_preemptions > 0 and llm.engine.stats().spec_decode["num_drafts"] > 0


def test_stops_and_max_tokens_cut_inside_an_accepted_run_as_without_speculation(tiny_llm_factory, reference):
    prompts, want = reference
    ref = tiny_llm_factory(num_blocks=128, batch_invariant=True)
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, speculative_config=_spec(8))
    stop = [want[0][0][9]]  # a token the greedy run emits 10th
    assert _generate(llm, prompts[:1], stop_token_ids=stop) == _generate(ref, prompts[:1], stop_token_ids=stop)
    for m in (1, 2, 5):
        assert _generate(llm, prompts[:2], max_tokens=m) == _generate(ref, prompts[:2], max_tokens=m)


def test_the_real_model_copies_text_with_long_accepted_runs(default_model_files):
    from pagedkv import LLM

    text = "The quick brown fox jumps over the lazy dog near the river bank. " * 3
    prompt = {"prompt": "Repeat exactly: " + text + "\nRepeat: "}
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ref = LLM(num_blocks=64, batch_invariant=True).generate([prompt], params)[0]
    llm = LLM(num_blocks=64, batch_invariant=True, debug_invariants=True, speculative_config=_spec(4))
    assert llm.generate([prompt], params)[0].token_ids == ref.token_ids
    s = llm.engine.stats().spec_decode
    assert s["acceptance_rate"] > 0.5 and s["mean_acceptance_length"] > 2.5, s


# ---- pieces ------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_earliest_longest_match():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [9, 1]  # earliest of two matches
    assert ngram_propose([5, 1, 2, 8, 6, 2], 3, 1, 3) == [8, 6, 2]  # only "2" matches; k tokens follow
    assert ngram_propose([5, 1, 2, 8, 6, 2], 3, 2, 3) == []  # no 2-gram match
    assert ngram_propose([4, 4], 4, 1, 2) == [4]  # what follows runs out
    assert ngram_propose([7], 4, 1, 2) == []


def test_the_adaptive_gate_pauses_a_request_whose_drafts_fail():
    g = AdaptiveGate()
    for _ in range(4):
        assert g.allows("r")
        g.record("r", 4, 0)  # 16 draft tokens, none accepted
    assert [g.allows("r") for _ in range(9)] == [False] * 8 + [True]
    g.record("r", 16, 16)
    assert g.allows("r")


def _counts(draws: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=vocab).double() / len(draws)


@pytest.mark.parametrize("draft", [0, 3, 4], ids=["likely", "unlikely", "outside-top-k"])
def test_rejection_sampling_draws_from_the_target_distribution(draft):
    """Total variation between the committed tokens' empirical distribution and the target's,
    over N = 20,000 draws on a 5-token vocabulary. The TV of an exact sampler's empirical
    distribution is about sum_i sqrt(p_i (1 - p_i) / N) / 2 <= 0.008 here, so 0.025 is over 3x
    that, while a sampler that keeps a one-hot draft unconditionally is off by >= 0.35."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -3.0], [0.0, 1.5, 0.2, 0.9, 0.1]])
    params = SP(temperature=0.8, top_k=4)
    p0 = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, float("-inf")]) / 0.8, -1).double()
    p1 = torch.softmax(torch.tensor([float("-inf"), 1.5, 0.2, 0.9, 0.1]) / 0.8, -1).double()  # top-4 drops 0.0
    gen = torch.Generator().manual_seed(1234)
    firsts, seconds = [], []
    for _ in range(20_000):
        run = [t.token_id for t in verify(logits, [draft], params, gen)]
        firsts.append(run[0])
        if len(run) == 2:
            seconds.append(run[1])
    assert 0.5 * (_counts(firsts, 5) - p0).abs().sum() < 0.025
    if draft != 4:  # after an accepted draft, the bonus token follows the next position's distribution
        assert 0.5 * (_counts(seconds, 5) - p1).abs().sum() < 0.04
    assert all(t != 4 for t in firsts)  # top-k holds for speculative tokens too


def test_bad_speculative_configs_are_refused_clearly():
    with pytest.raises(ValueError, match='"draft_model" needs "model"'):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_max: prompt lookup is method 'ngram'"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "x", "num_speculative_tokens": 2,
                                 "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match='"model" names a draft model'):
        SpeculativeConfig.parse({"method": "ngram", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 2})
    implied = SpeculativeConfig.parse({"model": "x", "num_speculative_tokens": 2})  # vLLM: a model means a draft
    assert (implied.method, implied.model) == ("draft_model", "x")
    with pytest.raises(ValueError, match='needs "method"'):
        SpeculativeConfig.parse({"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "k": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                                 "prompt_lookup_max": 2})
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)  # vLLM: a missing bound takes the other's


def test_the_cli_takes_a_speculative_config_and_reports_its_counters(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(tiny_model_dir),
                        "--speculative-config", json.dumps(_spec(3)), "--max-tokens", "12", "--no-chat",
                        "--json", "--temperature", "0", "one two three one two three one two three"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines[0]["token_ids"]) == 12 and lines[-1]["spec_decode"]["num_speculative_tokens"] == 3


def test_spec_counters_reach_prometheus(tiny_llm_factory, reference):
    from pagedkv.server.metrics import ServerMetrics

    prompts, _ = reference
    llm = tiny_llm_factory(num_blocks=128, speculative_config=_spec(2))
    _generate(llm, prompts[:2])
    s = llm.engine.stats().spec_decode
    text = ServerMetrics(llm.engine.stats).render().decode()
    assert f"pagedkv_spec_decode_num_draft_tokens_total {float(s['num_draft_tokens'])}" in text
    assert 'pagedkv_spec_decode_num_accepted_tokens_per_pos_total{position="1"}' in text


def test_a_stop_string_completed_inside_an_accepted_run_cuts_there(tiny_llm_factory, reference):
    import random

    r = random.Random(0)
    prompt = [r.randrange(100, 49000) for _ in range(20)]  # a random model repeats itself: long accepted runs
    ref = tiny_llm_factory(num_blocks=128, batch_invariant=True)
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, speculative_config=_spec(8))
    plain = ref.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=40, temperature=0.0))[0]
    tok = ref.get_tokenizer()
    stop = tok.decode(plain.token_ids[7:10])  # completed by the 10th token, mid-run for the speculative engine
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1, stop=[stop])
    want, got = (e.generate([{"prompt_token_ids": prompt}], params)[0] for e in (ref, llm))
    assert (got.token_ids, got.logprobs, got.text, got.finish_reason) == (
        want.token_ids, want.logprobs, want.text, want.finish_reason)
    assert want.finish_reason == "stop" and len(want.token_ids) <= 10
    assert llm.engine.stats().spec_decode["num_accepted_tokens"] > 0


def test_the_server_streams_several_tokens_per_step_with_the_same_text(tiny_model_dir, tiny_llm_factory):
    import openai

    from pagedkv.engine.engine import LLMEngine
    from pagedkv.server import ServerConfig, build_app
    from pagedkv.server.live import LiveServer

    prompt = "one two three one two three one two three one two"
    ref = tiny_llm_factory(num_blocks=64, batch_invariant=True).generate(
        [prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    engine = LLMEngine(model=str(tiny_model_dir), num_blocks=64, batch_invariant=True, debug_invariants=True,
                       speculative_config=_spec(8))
    srv = LiveServer(build_app(engine, ServerConfig(["tiny"]))).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        greedy = dict(model="tiny", prompt=prompt, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
        whole = c.completions.create(**greedy)
        chunks = list(c.completions.create(stream=True, **greedy))
    finally:
        srv.stop()
    assert whole.choices[0].text == "".join(ch.choices[0].text for ch in chunks) == ref.text
    assert whole.usage.completion_tokens == 32
    assert len(chunks) < 32  # accepted drafts arrive together


def test_blocks_committed_by_accepted_drafts_are_written_through_to_the_cpu_tier(tiny_llm_factory, reference):
    prompts, _ = reference
    saved = []
    for spec in (None, _spec(8)):
        llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, kv_offload_memory="2MiB", speculative_config=spec)
        _generate(llm, prompts[:1], max_tokens=60)
        saved.append(llm.engine.stats().kv_offload["blocks_saved"])
    assert saved[0] == saved[1] >= 4  # every full block of prompt + output, with or without drafts


def test_the_servers_ready_line_says_speculation_is_on(tiny_llm_factory):
    from pagedkv.server.cli import _spec as ready_spec

    assert ready_spec(tiny_llm_factory(speculative_config=_spec(3)).engine) == "; speculative decoding: ngram, 3 drafts"
    assert ready_spec(tiny_llm_factory().engine) == ""
