"""Speculative decoding with a draft model (issue 13): the draft's KV lives in the target's
pages and is rolled back, prefix-cached, offloaded and preempted with them.

Checked on the tiny model: greedy output token- and log-prob-identical to decoding without
speculation for k in {1, 2, 4, 8} at prompt lengths around block edges, in a mixed batch,
under preemption, with prefix caching, quantized pages and the CPU tier; the target as
its own draft is accepted every time (batch-invariant mode: the draft computes the same
bits), which fails if any draft KV the proposer relies on is stale (a prefix hit, a tier
load, a swap-in or a rolled-back page that lacked the draft's KV); a random draft of
another shape is (almost) never accepted and changes nothing.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import make_hf_folder
from test_spec_decode import LENGTHS, _generate, _prompt, _run_checked

from pagedkv.kv.spec import pool_cache_bytes, pool_num_blocks


@pytest.fixture(scope="module")
def random_draft_dir(tmp_path_factory, default_model_files):
    """A random one-layer, one-KV-head draft with the target's tokenizer (another shape)."""
    return make_hf_folder(tmp_path_factory.mktemp("draft"), seed=7, tokenizer_from=default_model_files.folder,
                          num_hidden_layers=1, num_key_value_heads=1)


@pytest.fixture(scope="module")
def reference(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True)
    prompts = [_prompt(n, i) for i, n in enumerate(LENGTHS)] + [list(range(900, 940))]
    return prompts, _generate(llm, prompts)


def _draft(model, k: int) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_target_as_its_own_draft_is_always_accepted_and_output_is_identical(
        tiny_llm_factory, tiny_model_dir, reference, k):
    prompts, want = reference
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, speculative_config=_draft(tiny_model_dir, k))
    assert _run_checked(llm, prompts, k) == want
    s = llm.engine.stats().spec_decode
    assert s["num_draft_tokens"] > 0 and s["acceptance_rate"] == 1.0, s
    assert llm.engine.kv_manager.pool.num_available == llm.engine.kv_manager.pool.num_blocks  # every page back


@pytest.mark.parametrize("k", [1, 4, 8])
def test_a_random_draft_of_another_shape_is_rejected_and_changes_nothing(tiny_llm_factory, random_draft_dir,
                                                                         reference, k):
    prompts, want = reference
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, speculative_config=_draft(random_draft_dir, k))
    assert _run_checked(llm, prompts, k) == want
    s = llm.engine.stats().spec_decode
    assert s["num_draft_tokens"] > 0 and s["acceptance_rate"] < 0.05, s


def test_prefix_hits_serve_the_drafts_kv_too(tiny_llm_factory, tiny_model_dir, reference):
    """The second pass reuses published pages: had they lacked the draft's KV, its
    proposals after the hit would be wrong and acceptance would fall below 1."""
    prompts, want = reference
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, enable_prefix_caching=True,
                           speculative_config=_draft(tiny_model_dir, 4))
    assert _run_checked(llm, prompts, 4) == want
    assert _run_checked(llm, prompts, 4) == want
    st = llm.engine.stats()
    assert st.prefix_cache_hits > 0.3 * st.prefix_cache_queries and st.spec_decode["acceptance_rate"] == 1.0, st


def test_preemption_on_a_tiny_pool_rolls_both_caches_back(tiny_llm_factory, tiny_model_dir, reference):
    prompts, want = reference
    llm = tiny_llm_factory(num_blocks=12, batch_invariant=True, speculative_config=_draft(tiny_model_dir, 4))
    assert _run_checked(llm, prompts, 4) == want
    st = llm.engine.stats()
    assert st.num_preemptions > 0 and st.spec_decode["acceptance_rate"] == 1.0, st


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_cpu_tier_and_swaps_carry_the_drafts_layers(tiny_llm_factory, tiny_model_dir, reference, mode):
    """Pages that come back from the CPU tier (a prefix dropped from the device, or a
    swapped-out victim) must bring the draft's KV: acceptance stays 1."""
    prompts, want = reference
    llm = tiny_llm_factory(num_blocks=12, batch_invariant=True, enable_prefix_caching=True,
                           kv_offload_memory="4MiB", preemption_mode=mode, speculative_config=_draft(tiny_model_dir, 4))
    assert _run_checked(llm, prompts, 4) == want
    assert llm.engine.stats().preemptions_by_mode[mode] > 0
    llm.engine.kv_manager.reset_prefix_cache()  # the device forgets: the prompts' blocks come from the tier
    assert _run_checked(llm, prompts[4:], 4) == want[4:]
    st = llm.engine.stats()
    assert st.kv_offload["blocks_loaded"] > 0, st.kv_offload
    assert st.spec_decode["acceptance_rate"] == 1.0, st.spec_decode


def test_int8_pages_hold_both_models_kv(tiny_llm_factory, tiny_model_dir, random_draft_dir, reference):
    prompts, _ = reference
    want = _generate(tiny_llm_factory(num_blocks=128, batch_invariant=True, kv_cache_dtype="int8"), prompts)
    for draft in (tiny_model_dir, random_draft_dir):
        llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, kv_cache_dtype="int8",
                               speculative_config=_draft(draft, 4))
        assert _generate(llm, prompts) == want


def test_sampled_requests_run_and_a_seed_repeats(tiny_llm_factory, random_draft_dir, reference):
    from pagedkv import SamplingParams

    prompts, _ = reference
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, speculative_config=_draft(random_draft_dir, 4))
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=3, ignore_eos=True)
    runs = [[o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params)]
            for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 20 for t in runs[0])
    assert llm.engine.stats().spec_decode["num_draft_tokens"] > 0


def test_one_pool_holds_both_models_pages(tiny_llm_factory, random_draft_dir):
    """Same budget, fewer pages: each page holds a block of the target's and the draft's layers."""
    plain = tiny_llm_factory(num_blocks=None, kv_cache_memory=1 << 20)
    llm = tiny_llm_factory(num_blocks=None, kv_cache_memory=1 << 20, speculative_config=_draft(random_draft_dir, 2))
    parts = llm.engine.parts
    specs = (parts.kv_spec, parts.draft.kv_spec)
    assert parts.draft.kv_spec.num_layers == 1 and parts.draft.kv_spec.num_kv_heads == 1
    num_blocks = llm.engine.kv_manager.pool.num_blocks
    assert num_blocks == pool_num_blocks(specs, 1 << 20) < plain.engine.kv_manager.pool.num_blocks
    assert parts.kv_cache.nbytes == pool_cache_bytes(specs, llm.engine.kv_manager.pool.num_blocks)
    assert parts.kv_cache.num_layers == parts.kv_spec.num_layers + 1
    assert llm.engine.stats().kv_bytes_per_token == parts.kv_spec.bytes_per_token + parts.draft.kv_spec.bytes_per_token


def test_a_draft_with_another_vocabulary_is_refused(tiny_llm_factory, tmp_path, default_model_files):
    other = make_hf_folder(tmp_path / "other", tokenizer_from=default_model_files.folder, vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens.*target's tokenizer"):
        tiny_llm_factory(speculative_config=_draft(other, 2))
    bare = make_hf_folder(tmp_path / "bare")
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        tiny_llm_factory(speculative_config=_draft(bare, 2))
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        tiny_llm_factory(speculative_config=_draft(tmp_path / "missing", 2))


def test_the_cli_runs_a_draft_model(tiny_model_dir):
    import json

    spec = json.dumps(_draft(tiny_model_dir, 3))
    r = subprocess.run([sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(tiny_model_dir),
                        "--max-tokens", "12", "--temperature", "0", "--no-chat", "--speculative-config", spec,
                        "--batch-invariant",  # the draft's 1-2 row products then match the target's bits
                        "--json", "Hello there"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout.splitlines()[-1])["spec_decode"]
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] == 1.0, stats


def test_verification_keeps_the_targets_distribution_for_equal_and_disjoint_drafts():
    """Rejection sampling with a draft distribution ``q`` (Leviathan et al. 2023, Alg. 1).

    On a 6-token vocabulary, 20,000 draws of the first committed token from a fixed seed:
    the total-variation distance to the target's ``p`` must stay under 0.02. The standard
    error of one category's frequency is at most sqrt(0.25 / 20000) = 0.0035, so a correct
    sampler's TV (half the summed absolute errors over 6 categories) is about 0.01 at
    most, and a sampler that kept the draft's distribution would be off by TV(p, q) >= 0.3.
    - equal (q = p): every draft is accepted, so the committed token is the draft;
    - disjoint (q's support outside p's): every draft is rejected, the residual is p;
    - overlapping (q skewed toward one token): the general case.
    """
    from pagedkv.core.sampling_params import SamplingParams as SP
    from pagedkv.worker.spec_decode.verify import verify

    logits = torch.tensor([[2.0, 1.0, 0.5, -9e9, -9e9, -9e9], [0.0] * 6])
    params = SP(temperature=1.0, max_tokens=4)
    p = torch.softmax(logits[0], -1)
    cases = {"equal": p.clone(), "disjoint": torch.tensor([0.0, 0.0, 0.0, 0.2, 0.3, 0.5]),
             "overlapping": torch.tensor([0.05, 0.05, 0.8, 0.1, 0.0, 0.0])}
    for name, q in cases.items():
        gen, counts, accepted = torch.Generator().manual_seed(11), torch.zeros(6), 0
        for _ in range(20000):
            x = int(torch.multinomial(q, 1, generator=gen))
            run = verify(logits, [x], params, gen, q.unsqueeze(0))
            counts[run[0].token_id] += 1
            accepted += len(run) == 2
        tv = 0.5 * float((counts / counts.sum() - p).abs().sum())
        assert tv < 0.02, (name, tv, counts)
        if name == "equal":
            assert accepted == 20000
        if name == "disjoint":
            assert accepted == 0


def test_chunked_prefill_keeps_the_draft_in_step(tiny_llm_factory, tiny_model_dir, reference):
    """Prompts prefilled 8 tokens a step: the draft catches up on every chunk."""
    prompts, want = reference
    llm = tiny_llm_factory(num_blocks=128, batch_invariant=True, max_num_batched_tokens=8,
                           speculative_config=_draft(tiny_model_dir, 4))
    assert _run_checked(llm, prompts, 4) == want
    assert llm.engine.stats().spec_decode["acceptance_rate"] == 1.0


def test_a_restart_serves_the_drafts_kv_from_disk(tiny_llm_factory, tiny_model_dir, reference, tmp_path):
    import gc

    prompts, want = reference
    kw = dict(num_blocks=12, batch_invariant=True, kv_offload_memory="1MiB", kv_offload_dir=str(tmp_path),
              speculative_config=_draft(tiny_model_dir, 4))
    first = tiny_llm_factory(**kw)
    assert _generate(first, prompts[4:]) == want[4:]
    first.close()
    del first
    gc.collect()  # the directory's lock goes with the engine
    second = tiny_llm_factory(**kw)
    assert _generate(second, prompts[4:]) == want[4:]
    st = second.engine.stats()
    assert st.kv_offload["disk_hit_tokens"] > 0 and st.spec_decode["acceptance_rate"] == 1.0, st


def test_the_servers_ready_line_names_the_draft(tiny_llm_factory, random_draft_dir):
    from pagedkv.server.cli import _spec as ready_spec

    line = ready_spec(tiny_llm_factory(speculative_config=_draft(random_draft_dir, 3)).engine)
    assert line == f"; speculative decoding: draft_model {random_draft_dir}, 3 drafts"


def test_a_draft_with_a_shorter_position_limit_caps_the_length_and_calibrates_within_it(
        tiny_llm_factory, default_model_files, tmp_path):
    short = make_hf_folder(tmp_path / "short", tokenizer_from=default_model_files.folder, max_position_embeddings=64)
    llm = tiny_llm_factory(num_blocks=32, kv_cache_dtype="int8", kv_cache_scale="per-tensor",
                           speculative_config=_draft(short, 2))  # static scales calibrated within 64 positions
    assert llm.engine.max_model_len == 64
    with pytest.raises(ValueError, match="exceeds the draft model's limit of 64 tokens"):
        tiny_llm_factory(max_model_len=128, speculative_config=_draft(short, 2))
    with pytest.raises(FileNotFoundError, match="speculative_config draft model"):
        tiny_llm_factory(speculative_config=_draft(tmp_path / "missing", 2))


def test_greedy_verification_reads_no_row_past_the_first_rejection():
    """Rows after a rejected draft were computed from a token that is thrown away: a
    non-finite value there must not fail the request."""
    from pagedkv.core.sampling_params import SamplingParams as SP
    from pagedkv.worker.spec_decode.verify import verify

    logits = torch.tensor([[0.0, 5.0, 1.0], [float("nan")] * 3, [float("inf")] * 3])
    run = verify(logits, [2, 0], SP(temperature=0.0, max_tokens=4), None)
    assert [t.token_id for t in run] == [1]
    with pytest.raises(ValueError, match="non-finite"):
        verify(logits, [1, 0], SP(temperature=0.0, max_tokens=4), None)


def test_a_draft_whose_distribution_fails_fails_no_request(tiny_llm_factory, default_model_files, tmp_path):
    """Draft logits of 1e35 overflow at temperature 1e-5: that request proposes nothing this
    step (the target samples as without speculation); its neighbours are untouched."""
    import glob

    from safetensors.torch import load_file, save_file

    from pagedkv import SamplingParams

    drf = make_hf_folder(tmp_path / "hot", tokenizer_from=default_model_files.folder, tie_word_embeddings=False)
    f = glob.glob(f"{drf}/*.safetensors")[0]
    sd = load_file(f)
    sd["lm_head.weight"] *= 1e35
    save_file(sd, f, metadata={"format": "pt"})
    llm = tiny_llm_factory(num_blocks=16, speculative_config=_draft(drf, 2))
    outs = llm.generate([{"prompt_token_ids": [100, 200, 300]}, {"prompt_token_ids": [7, 8, 9]}],
                        [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                         SamplingParams(max_tokens=8, temperature=1e-5, ignore_eos=True)])
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", 8), ("length", 8)]


def test_the_planner_counts_the_draft_as_the_engine_allocates_it(tiny_llm_factory, tiny_model_dir, random_draft_dir):
    from pagedkv.planner import plan

    spec = _draft(random_draft_dir, 2)
    llm = tiny_llm_factory(num_blocks=None, kv_cache_memory=1 << 20, speculative_config=spec)
    r = plan(model=str(tiny_model_dir), kv_cache_dtype="float32", kv_cache_memory=1 << 20, speculative_config=spec)
    alone = plan(model=str(tiny_model_dir), kv_cache_dtype="float32", kv_cache_memory=1 << 20)
    assert r.num_blocks == llm.engine.kv_manager.pool.num_blocks < alone.num_blocks
    assert r.bytes_per_token + r.draft_bytes_per_token == llm.engine.stats().kv_bytes_per_token
    assert r.draft_weight_bytes > 0 and alone.draft_model is None
