"""H2O eviction (issue 14, ``--kv-eviction h2o``): heavy hitters by accumulated attention,
evicted when a prompt over the budget ends and whenever the cache grows a block past it.
Checked against the recipe run on HF's own attention maps, decoding from HF's pruned cache."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.worker.eviction_scores import select_tokens

H2O = dict(kv_eviction="h2o", kv_budget_tokens=24, num_sink_tokens=2, kv_window_tokens=8, block_size=4,
           num_blocks=96, max_num_batched_tokens=16)
PROMPT = torch.randint(0, 49152, (50,), generator=torch.Generator().manual_seed(11)).tolist()
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def hf_h2o(folder, prompt, n, budget=24, sinks=2, window=8, block=4):
    """H2O on HF (eager attention): greedy tokens, and per eviction (the position computed
    last before it, the positions kept)."""
    from transformers import DynamicCache, LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(folder), attn_implementation="eager").float().eval()

    def mass(attentions):  # [1, H, q, L] per layer -> [L]
        return sum(a[0].double().sum(dim=(0, 1)) for a in attentions)

    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_attentions=True, use_cache=True)
    acc, cache, positions, kept = mass(out.attentions), out.past_key_values, list(range(len(prompt))), []

    def evict():
        nonlocal acc, cache, positions
        keep = select_tokens(acc, budget, sinks, window)
        pruned, idx = DynamicCache(), torch.tensor(keep)
        for i, layer in enumerate(cache.layers):
            pruned.update(layer.keys[:, :, idx], layer.values[:, :, idx], i)
        kept.append((positions[-1], [positions[i] for i in keep]))
        acc, cache, positions = acc[idx], pruned, kept[-1][1]

    if len(prompt) > budget:
        evict()
    tokens, nxt, pos = [], out.logits[0, -1].argmax().item(), len(prompt)
    while len(tokens) < n - 1:
        tokens.append(nxt)
        with torch.no_grad():
            out = hf(torch.tensor([[nxt]]), position_ids=torch.tensor([[pos]]), cache=cache, use_cache=True,
                     output_attentions=True)
        cache, positions, pos = out.past_key_values, positions + [pos], pos + 1
        acc = torch.cat([acc, torch.zeros(1, dtype=torch.float64)]) + mass(out.attentions)
        nxt = out.logits[0, -1].argmax().item()
        if len(positions) == budget + block:
            evict()
    return tokens + [nxt], kept


@pytest.mark.parametrize("prompt_len", [50, 20])
def test_h2o_matches_the_recipe_on_hf(tiny_model_dir, prompt_len):
    """A prompt over the budget (evicted at its end, then every 4 tokens) and one under it
    (evicted once decoding has filled the budget and a block)."""
    prompt = PROMPT[:prompt_len]
    llm = LLM(model=str(tiny_model_dir), debug_invariants=True, **H2O)
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    tokens, kept = hf_h2o(tiny_model_dir, prompt, 30)
    assert out.token_ids == tokens
    assert len(kept) >= 5 and all(k[:2] == [0, 1] for _, k in kept)  # evicted again and again; sinks stay
    # the engine compacts when the request runs again: not after its last step (position P + 28)
    applied = [(last, k) for last, k in kept if last < prompt_len + 28]
    sizes = [(prompt_len if i == 0 and prompt_len > 24 else 28) - 24 for i in range(len(applied))]
    assert llm.engine.stats().tokens_evicted == sum(sizes)
    assert llm.engine.kv_manager.usage().used == 0


def test_h2o_holds_a_bounded_number_of_pages_while_decoding(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), debug_invariants=True, **H2O)
    eng = llm.engine
    eng.add_request({"prompt_token_ids": PROMPT[:20]}, SamplingParams(max_tokens=120, temperature=0.0,
                                                                       ignore_eos=True), request_id="r")
    held = []
    while eng.has_unfinished_requests():
        eng.step()
        held.append(len(eng.kv_manager.get_block_ids("r")[0]))
    assert max(held) <= (24 + 4) // 4 + 1  # the budget, a block of growth, one being written
    # 139 tokens cached in all: a choice each time the cache reaches 28 (after 28, 32, ...
    # tokens), each compacted down to 24 when the request runs again (not after its last step)
    assert eng.stats().tokens_evicted == sum(4 for t in range(28, 140, 4) if t < 139)


def test_h2o_outputs_do_not_depend_on_batching_or_preemption(tiny_model_dir):
    prompts = [{"prompt_token_ids": PROMPT[i:] + PROMPT[:i]} for i in (0, 9, 21)]
    alone = [LLM(model=str(tiny_model_dir), **H2O).generate([p], GREEDY)[0].token_ids for p in prompts]
    llm = LLM(model=str(tiny_model_dir), debug_invariants=True, **(H2O | {"num_blocks": 24}))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert llm.engine.stats().num_preemptions > 0 and llm.engine.kv_manager.usage().used == 0


def test_h2o_generates_past_the_whole_cache_in_its_bounded_pages(tiny_model_dir):
    """H2O holds at most its budget + a page (a prompt over the budget: the prompt, until it
    is scored), so a cache of exactly that many pages runs a request far longer than the
    cache, with the same tokens as a large one; one page less is refused at once, as is a
    prompt the cache cannot hold whole."""
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    for prompt, pages in ((PROMPT[:20], (24 + 4) // 4), (PROMPT, 50 // 4 + 1)):
        alone = LLM(model=str(tiny_model_dir), **H2O).generate([{"prompt_token_ids": prompt}], params)[0]
        small = LLM(model=str(tiny_model_dir), debug_invariants=True, **(H2O | {"num_blocks": pages}))
        assert small.engine.max_model_len > pages * 4  # not capped at what the cache holds densely
        out = small.generate([{"prompt_token_ids": prompt}], params)[0]
        assert out.token_ids == alone.token_ids and small.engine.peak_blocks_used <= pages
        with pytest.raises(ValueError, match="exceeds max_model_len|whole cache has"):
            LLM(model=str(tiny_model_dir), **(H2O | {"num_blocks": pages - 1})).generate(
                [{"prompt_token_ids": prompt}], params)


def test_h2o_runs_under_a_step_budget_smaller_than_its_window(tiny_model_dir):
    """Only SnapKV's observation window must run in one step; H2O scores every query."""
    prompt = [{"prompt_token_ids": PROMPT[:30]}]
    alone = LLM(model=str(tiny_model_dir), **H2O).generate(prompt, GREEDY)[0].token_ids
    tiny_steps = LLM(model=str(tiny_model_dir), debug_invariants=True, **(H2O | {"max_num_batched_tokens": 3}))
    assert tiny_steps.generate(prompt, GREEDY)[0].token_ids == alone
