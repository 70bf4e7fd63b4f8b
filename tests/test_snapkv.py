"""SnapKV eviction that frees pages (issue 14, ``--kv-eviction snapkv``): the scores and
the kept tokens equal SnapKV's recipe computed from HF's own attention maps, generation
after compaction equals HF generating from the pruned cache at the original positions,
the pages go back, and budgets at or above the prompt change nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv import LLM, EngineConfig, SamplingParams
from pagedkv.worker.eviction_scores import POOL_KERNEL, select_tokens

SNAP = dict(kv_eviction="snapkv", kv_budget_tokens=24, num_sink_tokens=2, kv_window_tokens=8, block_size=4,
            num_blocks=96, max_num_batched_tokens=16)
PROMPT = torch.randint(0, 49152, (70,), generator=torch.Generator().manual_seed(7)).tolist()
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)


def run(folder, prompt=PROMPT, params=GREEDY, **kw):
    llm = LLM(model=str(folder), debug_invariants=True, **kw)
    kept = []
    choose = llm.engine.runner._choose
    llm.engine.runner._choose = lambda scorer, out: kept.append(choose(scorer, out)) or kept[-1]
    return llm, llm.generate([{"prompt_token_ids": prompt}], params)[0], kept


def hf_snapkv(folder, prompt, budget, sinks, window):
    """SnapKV's recipe on HF's eager attention maps; returns (kept positions, the model, its cache)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(folder), attn_implementation="eager").float().eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_attentions=True, use_cache=True)
    score = torch.zeros(len(prompt), dtype=torch.float64)
    for att in out.attentions:  # [1, H, L, L]
        mass = att[0, :, -window:, :].sum(dim=1)
        score += F.max_pool1d(mass.unsqueeze(0), POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)[0].sum(0).double()
    return select_tokens(score, budget, sinks, window), hf, out.past_key_values


def hf_generate_pruned(hf, cache, prompt, keep, n):
    from transformers import DynamicCache

    pruned = DynamicCache()
    idx = torch.tensor(keep)
    for i, layer in enumerate(cache.layers):
        pruned.update(layer.keys[:, :, idx], layer.values[:, :, idx], i)
    tokens, pos = [], len(prompt)
    with torch.no_grad():
        nxt = hf(torch.tensor([prompt])).logits[0, -1].argmax().item()  # the first token: the full prompt
        for _ in range(n - 1):
            tokens.append(nxt)
            logits = hf(torch.tensor([[nxt]]), position_ids=torch.tensor([[pos]]), cache=pruned,
                        use_cache=True).logits
            nxt, pos = logits[0, -1].argmax().item(), pos + 1
    return tokens + [nxt]


def test_kept_tokens_and_generation_match_hf_on_the_pruned_cache(tiny_model_dir):
    llm, out, kept = run(tiny_model_dir, **SNAP)
    keep, hf, cache = hf_snapkv(tiny_model_dir, PROMPT, 24, 2, 8)
    assert [list(k.values()) for k in kept] == [[keep]]  # scored once, as SnapKV on HF's attention
    assert len(keep) == 24 and keep[:2] == [0, 1] and keep[-8:] == list(range(62, 70))
    assert out.token_ids == hf_generate_pruned(hf, cache, PROMPT, keep, 12)
    stats = llm.engine.stats()
    assert stats.tokens_evicted == 70 - 24 and stats.blocks_freed_by_eviction == 18 - 6
    assert llm.engine.kv_manager.usage().used == 0


def test_eviction_changes_the_output_and_frees_pages_while_it_runs(tiny_model_dir):
    _, full, _ = run(tiny_model_dir, block_size=4, num_blocks=96, max_num_batched_tokens=16)
    llm = LLM(model=str(tiny_model_dir), debug_invariants=True, **SNAP)
    eng = llm.engine
    eng.add_request({"prompt_token_ids": PROMPT}, GREEDY, request_id="r")
    held = []
    while eng.has_unfinished_requests():
        eng.step()
        held.append(len(eng.kv_manager.get_block_ids("r")[0]))
    assert max(held) == 18 and held[-2] <= 6 + 3  # the prompt's pages, then the budget's and the outputs'
    _, snap, _ = run(tiny_model_dir, **SNAP)
    assert snap.token_ids != full.token_ids


@pytest.mark.parametrize("budget", [70, 200])
def test_a_budget_at_or_above_the_prompt_changes_nothing(tiny_model_dir, budget):
    _, full, _ = run(tiny_model_dir, block_size=4, num_blocks=96, max_num_batched_tokens=16)
    _, same, kept = run(tiny_model_dir, **(SNAP | {"kv_budget_tokens": budget}))
    assert (same.token_ids, same.logprobs) == (full.token_ids, full.logprobs) and kept == []


def test_per_request_budgets_and_batching_give_the_same_tokens(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), debug_invariants=True, **(SNAP | {"kv_budget_tokens": 200}))
    alone = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**(vars(GREEDY) | {"kv_budget_tokens": 24})))
    _, ref, _ = run(tiny_model_dir, **SNAP)
    assert alone[0].token_ids == ref.token_ids
    others = [{"prompt_token_ids": PROMPT[i:] + PROMPT[:i]} for i in (5, 17)]
    batch = llm.generate([{"prompt_token_ids": PROMPT}] + others,
                         [SamplingParams(**(vars(GREEDY) | {"kv_budget_tokens": 24}))] + [GREEDY] * 2)
    assert batch[0].token_ids == ref.token_ids and llm.engine.kv_manager.usage().used == 0


def test_prefix_hits_leave_the_window_to_compute_and_repeat_the_output(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), debug_invariants=True, **SNAP)
    first = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0]
    second = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0]
    assert second.num_cached_tokens == 60  # whole blocks, leaving the 8-token window (70 - 8 = 62 -> 60)
    assert second.token_ids == first.token_ids


def test_preemption_recomputes_scores_and_compacts_again(tiny_model_dir):
    """A pool too small for two uncompacted prompts: requests are preempted and recomputed,
    compactions find no fresh pages and reuse the request's own, and each request still
    produces what it produces alone."""
    params = SamplingParams(**(vars(GREEDY) | {"max_tokens": 30}))
    prompts = [{"prompt_token_ids": PROMPT[i:] + PROMPT[:i]} for i in (0, 9, 21)]
    alone = [LLM(model=str(tiny_model_dir), **SNAP).generate([p], params)[0].token_ids for p in prompts]
    llm = LLM(model=str(tiny_model_dir), debug_invariants=True, **(SNAP | {"num_blocks": 30,
                                                                          "enable_prefix_caching": False}))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert llm.engine.stats().num_preemptions > 0 and llm.engine.kv_manager.usage().used == 0


def test_a_resumed_request_with_outputs_is_scored_again_after_a_prefix_hit(tiny_model_dir):
    """Found by a break-it pass: a preempted request resumed from the prefix cache took a hit
    past its prompt's observation window (counted from prompt + outputs) and was never
    pruned again. A pool of 33 pages preempts it; its tokens must be those it makes alone."""
    longer = PROMPT + torch.randint(0, 49152, (10,), generator=torch.Generator().manual_seed(9)).tolist()
    mine = SamplingParams(**(vars(GREEDY) | {"max_tokens": 20}))
    other = SamplingParams(**(vars(GREEDY) | {"max_tokens": 40, "kv_budget_tokens": 200}))
    _, alone, _ = run(tiny_model_dir, params=mine, **(SNAP | {"num_blocks": 200}))
    for caching in (True, False):
        llm = LLM(model=str(tiny_model_dir), debug_invariants=True,
                  **(SNAP | {"num_blocks": 33, "enable_prefix_caching": caching}))
        outs = llm.generate([{"prompt_token_ids": longer}, {"prompt_token_ids": PROMPT}], [other, mine])
        assert outs[1].token_ids == alone.token_ids and llm.engine.stats().num_preemptions > 0
        assert llm.engine.kv_manager.usage().used == 0


@pytest.mark.parametrize("num_blocks", [22, 26, 29, 33])
def test_duplicates_sharing_prompt_pages_compact_or_wait_never_decode_uncompacted(tiny_model_dir, num_blocks):
    """Found by a break-it pass: with no free page and its own pages shared by prefix hits, a
    compaction was put off and the request decoded a token over its whole prompt. Now it
    preempts, as a failed allocation does, and every duplicate gives the lone output."""
    _, alone, _ = run(tiny_model_dir, **(SNAP | {"num_blocks": 64}))
    llm = LLM(model=str(tiny_model_dir), debug_invariants=True, **(SNAP | {"num_blocks": num_blocks}))
    llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)  # publishes the prompt's pages
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 4, GREEDY)
    assert [o.token_ids for o in outs] == [alone.token_ids] * 4 and llm.engine.kv_manager.usage().used == 0


def test_snapkv_settings_are_checked(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        EngineConfig(kv_eviction="snapkv")
    with pytest.raises(ValueError, match="at least num_sink_tokens"):
        EngineConfig(kv_eviction="snapkv", kv_budget_tokens=10)
    with pytest.raises(ValueError, match="applies to kv_eviction snapkv"):
        EngineConfig(kv_budget_tokens=100)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(kv_eviction="snapkv", kv_budget_tokens=100, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="must fit in one step"):
        EngineConfig(kv_eviction="snapkv", kv_budget_tokens=100, kv_window_tokens=64, max_num_batched_tokens=32)
    llm = LLM(model=str(tiny_model_dir), **SNAP)
    with pytest.raises(ValueError, match="under the engine's sinks"):
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(kv_budget_tokens=5))
    plain = LLM(model=str(tiny_model_dir), num_blocks=32)
    with pytest.raises(ValueError, match="needs an engine with snapkv"):
        plain.generate([{"prompt_token_ids": PROMPT}], SamplingParams(kv_budget_tokens=50))
    with pytest.raises(ValueError, match="positive integer"):
        SamplingParams(kv_budget_tokens=0)


def test_the_server_checks_a_budget_against_its_engine(tiny_model_dir):
    import httpx

    from pagedkv.engine.engine import LLMEngine
    from pagedkv.server import ServerConfig, build_app
    from pagedkv.server.live import LiveServer

    engine = LLMEngine(model=str(tiny_model_dir), **SNAP)
    srv = LiveServer(build_app(engine, ServerConfig(["tiny"]))).start()
    try:
        post = lambda budget: httpx.post(srv.url + "/v1/completions", json={  # noqa: E731
            "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "kv_budget_tokens": budget}, timeout=60)
        low = post(9)
        assert low.status_code == 400 and low.json()["error"]["param"] == "kv_budget_tokens", low.text
        ok = post(24)
        assert ok.status_code == 200, ok.text
        assert engine.stats().tokens_evicted == 70 - 24
    finally:
        srv.stop()


def test_snapkv_from_the_cli_and_the_needle_eval(tiny_model_dir):
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "pagedkv.cli"]
    flags = ["--model", str(tiny_model_dir), "--num-blocks", "64", "--kv-eviction", "snapkv"]
    r = subprocess.run(base + ["generate"] + flags + ["--kv-budget-tokens", "40", "--max-tokens", "5", "--no-chat",
                       "--json", "--ignore-eos", "The count of Monte Cristo " * 12], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[0])["token_ids"]) == 5
    r = subprocess.run(base + ["eval", "needle"] + flags + ["--lengths", "300", "--depths", "0.5",
                       "--num-trials", "1", "--kv-budget-fraction", "0.25", "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["trials"] == 1
    r = subprocess.run(base + ["eval", "needle", "--model", str(tiny_model_dir), "--lengths", "300",
                       "--kv-budget-fraction", "0.25"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--kv-eviction snapkv or h2o" in r.stderr
