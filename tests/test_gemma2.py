"""Gemma 2 (issue 14: interleaved sliding and full layers): a tiny random Gemma2ForCausalLM
against HF transformers' own model, with its extras exercised hard (attention and final
logit soft-capping at small caps, an attention scale that is not head_dim's, GeGLU,
four norms per layer with Gemma's ``1 + weight``, embeddings times sqrt(hidden)); whole and
chunked prefill across the window edge and decode past it, fused kernel and reference;
the engine's greedy tokens equal HF's ``generate``; its window and full layers in two KV
groups whose pages share tensors, holding exactly the planner's bytes."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import TINY_CONFIG
from test_forward_vs_hf import BLOCK, paged_logits

from pagedkv.model.llama import LlamaModel
from pagedkv.model.loader import load_model_config, load_state_dict

WINDOW = 12
TOL = 2e-4
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
             sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh", num_hidden_layers=4)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, default_model_files):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(21)
    cfg = Gemma2Config(**(TINY_CONFIG | GEMMA))
    model = Gemma2ForCausalLM(cfg).float()
    with torch.no_grad():  # HF inits small; widen so soft-capping and windows both bite
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.2)
    folder = tmp_path_factory.mktemp("gemma2")
    model.save_pretrained(str(folder))
    for f in default_model_files.folder.iterdir():  # the real SmolLM2 tokenizer, for the engine
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return folder


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(folder, ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ``ids``: exactly ``n`` tokens (EOS ignored)."""
    with torch.no_grad():
        out = hf_model(folder).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def test_the_config_reads_gemma2s_extras(gemma2_dir):
    cfg = load_model_config(gemma2_dir)
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None)  # sliding first, alternating
    assert cfg.sandwich_norms and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.attention_scale == 24 ** -0.5 and cfg.attn_logit_softcapping == 2.0
    assert cfg.final_logit_softcapping == 5.0 and cfg.embedding_multiplier == 64 ** 0.5


@pytest.mark.parametrize("length", [WINDOW - 1, WINDOW + 1, 2 * BLOCK, 3 * BLOCK + 5])
@pytest.mark.parametrize("attention", ["kernel", "reference"])
def test_gemma2_matches_hf(gemma2_dir, length, attention, monkeypatch):
    monkeypatch.setenv("PAGEDKV_ATTENTION", attention)
    model = LlamaModel(load_model_config(gemma2_dir), load_state_dict(gemma2_dir))
    ids = torch.randint(0, 49152, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.no_grad():
        ref = hf_model(gemma2_dir)(torch.tensor([ids])).logits[0]
    assert ref.abs().max() <= 5.0  # the final cap is in force ...
    assert ref.abs().max() > 3.0   # ... and reached: tanh is far from linear here
    head = [WINDOW - 1, 1, 1, BLOCK - WINDOW + 3]
    for chunks in ([length], [1] * length, head + [length - sum(head)] if length > sum(head) else [length]):
        diff = (paged_logits(model, ids, chunks) - ref).abs().max().item()
        assert diff < TOL, f"chunks {chunks[:5]}...: max |logit diff| {diff:.2e} vs HF"


def test_dropping_any_gemma_extra_breaks_the_match(gemma2_dir):
    """Each extra changes the logits on this model: a check that the test above can fail."""
    from dataclasses import replace

    cfg = load_model_config(gemma2_dir)
    ids = list(range(100, 100 + 2 * BLOCK))
    with torch.no_grad():
        ref = hf_model(gemma2_dir)(torch.tensor([ids])).logits[0]
    for change in (dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
                   dict(query_pre_attn_scalar=None), dict(hidden_act="silu"), dict(embedding_multiplier=None),
                   dict(layer_windows=())):
        model = LlamaModel(replace(cfg, **change), load_state_dict(gemma2_dir))
        assert (paged_logits(model, ids, [len(ids)]) - ref).abs().max().item() > 100 * TOL, change


def test_the_engine_generates_hfs_greedy_tokens_past_the_window(gemma2_dir):
    from pagedkv import LLM, SamplingParams

    ids = list(range(1000, 1000 + WINDOW + 5))
    llm = LLM(model=str(gemma2_dir), num_blocks=32, block_size=4, max_num_batched_tokens=8)
    got = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].token_ids
    want = hf_greedy(gemma2_dir, ids, 20)
    assert got == want


def test_window_and_full_layers_get_two_groups_sharing_pages(gemma2_dir):
    """Layers 0, 2 slide, 1, 3 attend fully: two groups of two layers; layer i of each group
    uses page slot i, so a page holds two layers and the pool has twice the pages of a
    single-group cache in the same memory."""
    from pagedkv import LLM

    llm = LLM(model=str(gemma2_dir), kv_cache_memory="1MiB", block_size=4)
    parts = llm.engine.parts
    assert [g.layer_ids for g in llm.engine.kv_manager.kv_groups] == [(0, 2), (1, 3)]
    assert parts.kv_cache.layer_slots == (0, 0, 1, 1) and parts.kv_spec.page_layers == 2
    assert parts.kv_cache.k[0] is parts.kv_cache.k[1] and parts.kv_cache.k[0] is not parts.kv_cache.k[2]
    assert llm.engine.stats().kv_bytes_per_token == parts.kv_spec.bytes_per_token  # every layer's, as plan/info say
    single = LLM(model=str(gemma2_dir), kv_cache_memory="1MiB", block_size=4, kv_offload_memory="1MiB")
    assert len(single.engine.kv_manager.kv_groups) == 1  # a tier copies whole tables: one group, every page
    assert parts.kv_cache.nbytes <= 2**20 and single.engine.parts.kv_cache.nbytes <= 2**20
    assert llm.engine.kv_manager.pool.num_blocks >= 2 * single.engine.kv_manager.pool.num_blocks - 1


def test_hybrid_pages_hold_the_planners_bytes_and_give_tokens_like_hf(gemma2_dir):
    """A request far past the window holds window-bounded pages in the window group and every
    page in the full one: exactly ``paged_bytes_for_tokens``; its greedy tokens equal HF's,
    alone and beside another request in a pool too small for both at full size."""
    from pagedkv import LLM, SamplingParams

    ids = list(range(2000, 2060))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(gemma2_dir), num_blocks=40, block_size=4, max_num_batched_tokens=8,
              enable_prefix_caching=False)
    eng, held = llm.engine, []
    step = eng.step
    eng.step = lambda: (held.append(eng.kv_manager.usage().used), step())[1]
    got = llm.generate([{"prompt_token_ids": ids}], params)[0].token_ids
    spec = eng.parts.kv_spec
    total = len(ids) + 20 - 1  # the last sampled token is never written
    assert max(held) * spec.page_size_bytes == spec.paged_bytes_for_tokens(total)
    assert eng.stats().blocks_freed_by_window > 0
    want = hf_greedy(gemma2_dir, ids, 20)
    assert got == want
    other = list(range(3000, 3050))
    both = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": other}], params)
    assert both[0].token_ids == want


def test_a_prefix_hit_under_pressure_never_gives_one_page_to_both_groups(gemma2_dir):
    """Every group's hit is pinned before any group takes new pages (one group's allocation
    could evict the other's unpinned hit and hand that page to both: found by a break-it
    pass). Repeated prefixes in a pool that preempts; the invariant check runs every step and
    the outputs equal a roomy engine's."""
    import random

    from pagedkv import LLM, SamplingParams

    rng = random.Random(3)
    base = [rng.randrange(49152) for _ in range(40)]
    prompts = []
    for i in range(8):
        k = rng.choice([1, 3, 4, 11, 12, 13, 16, 24, 33])
        prompts.append({"prompt_token_ids": base[:k] if i % 2 else [rng.randrange(49152) for _ in range(k)]})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    tight = LLM(model=str(gemma2_dir), block_size=4, batch_invariant=True, num_blocks=26, max_num_batched_tokens=8,
                debug_invariants=True)
    got = tight.generate(prompts, params)
    assert tight.engine.stats().prefix_cache_hits > 0 and tight.engine.stats().num_preemptions > 0
    roomy = LLM(model=str(gemma2_dir), block_size=4, batch_invariant=True, num_blocks=256, enable_prefix_caching=False)
    for a, p in zip(got, prompts):
        b = roomy.generate([p], params)[0]
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_groups_hits_of_different_lengths_are_looked_up_again_at_the_shorter_one(gemma2_dir):
    """The full group finds fewer cached blocks than the window group: the window group's hit
    must be the one for that shorter length (the pages its window reads there), not its longer
    hit cut short, whose leading entries are null pages (a recheck pass found logprobs drifting
    past the window with block size 1, prefix caching and preemptions)."""
    import random

    from pagedkv import LLM, SamplingParams

    rng = random.Random(10)
    base = [rng.randrange(49152) for _ in range(40)]
    prompts = []
    for i in range(8):
        k = rng.choice([1, 3, 4, 11, 12, 13, 16, 24, 33])
        prompts.append(base[:k] if i % 2 else [rng.randrange(49152) for _ in range(k)])
    prompts = [{"prompt_token_ids": p} for p in prompts + prompts[:3]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    tight = LLM(model=str(gemma2_dir), block_size=1, batch_invariant=True, num_blocks=120, max_num_batched_tokens=8,
                debug_invariants=True)
    got = tight.generate(prompts, params)
    roomy = LLM(model=str(gemma2_dir), block_size=1, batch_invariant=True, num_blocks=1024, enable_prefix_caching=False)
    for a, p in zip(got, prompts):
        b = roomy.generate([p], params)[0]
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_max_model_len_is_what_both_groups_hold_at_once(gemma2_dir):
    """"Fill the cache" (no max_tokens) must fit: max_model_len comes from the longest request
    whose pages in both groups fit the pool, not from pages x block size."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=str(gemma2_dir), block_size=4, num_blocks=40)
    kv = llm.engine.kv_manager
    assert llm.engine.max_model_len == 80  # 20 full-group + 20 window-group pages of 4 tokens
    assert kv.peak_blocks(80, 2048) <= 40 < kv.peak_blocks(81, 2048)
    out = llm.generate([{"prompt_token_ids": list(range(500, 531))}],
                       SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 80 - 31


def test_a_gemma2_draft_keeps_whole_layer_pages_within_the_budget(gemma2_dir):
    """A draft reads the target's one table: the target falls back to one group and both
    specs' pages hold every layer, so the storage stays within kv_cache_memory."""
    from pagedkv import LLM

    llm = LLM(model=str(gemma2_dir), kv_cache_memory="1MiB", block_size=4,
              speculative_config={"model": str(gemma2_dir), "num_speculative_tokens": 2})
    parts = llm.engine.parts
    assert len(llm.engine.kv_manager.kv_groups) == 1
    assert parts.kv_spec.page_layers == 0 and parts.draft.kv_spec.page_layers == 0
    assert parts.kv_cache.nbytes <= 2**20


def test_streaming_leaves_the_models_own_windows_alone(gemma2_dir):
    """Streaming's sinks + window apply to layers that read more than its window; Gemma's own
    window layers keep theirs, so a streaming window past the whole sequence changes nothing."""
    from pagedkv import LLM, SamplingParams

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": list(range(700, 700 + n))} for n in (5, 13, 20, 40)]
    dense = LLM(model=str(gemma2_dir), block_size=4, num_blocks=200).generate(prompts, params)
    stream = LLM(model=str(gemma2_dir), block_size=4, num_blocks=200, kv_eviction="streaming",
                 kv_window_tokens=400, num_sink_tokens=4, max_model_len=500)
    assert [layer.sinks for layer in stream.engine.model.layers] == [0, 4, 0, 4]
    for a, b in zip(dense, stream.generate(prompts, params)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
