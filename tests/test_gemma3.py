"""Gemma 3 (issue 14: five sliding-window layers to one full layer) and Qwen 3: tiny random
models against HF transformers' own, with what is new over Gemma 2 exercised hard: q and k
RMS-normed per head before RoPE (Gemma's ``1 + weight``; Qwen 3's plain weight), the window
layers' own RoPE base beside the full layers' scaled one, no soft-capping; whole and chunked
prefill across the window edge and decode past it, fused kernel and reference; the engine's
greedy tokens equal HF's ``generate``."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIG
from test_forward_vs_hf import BLOCK, paged_logits
from test_gemma2 import hf_greedy, hf_model
from test_sliding_window import save_random

from pagedkv.model.llama import LlamaModel
from pagedkv.model.loader import load_model_config, load_state_dict

WINDOW = 12
TOL = 2e-4
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
GEMMA3 = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, num_hidden_layers=len(LAYER_TYPES),
              layer_types=LAYER_TYPES, hidden_activation="gelu_pytorch_tanh",
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})


def _save(model, folder, default_model_files):
    # HF inits small; widen so the norms, RoPE bases and windows all bite
    return save_random(model, folder, default_model_files.folder, std=0.3, vector_std=0.2)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, default_model_files):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(31)
    tiny = {k: v for k, v in TINY_CONFIG.items() if k != "rope_theta"}
    model = Gemma3ForCausalLM(Gemma3TextConfig(**(tiny | GEMMA3))).float()
    return _save(model, tmp_path_factory.mktemp("gemma3"), default_model_files)


def hf_logits(folder, ids):
    with torch.no_grad():
        return hf_model(folder)(torch.tensor([ids])).logits[0]


def test_the_config_reads_gemma3s_extras(gemma3_dir):
    cfg = load_model_config(gemma3_dir)
    assert cfg.layer_windows == (WINDOW,) * 5 + (None,) + (WINDOW,) * 2
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_pytorch_tanh"
    ropes = (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.local_rope_theta, cfg.local_rope_scaling)
    assert ropes == (1e6, 4.0, 10.0, None)
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    assert cfg.attention_scale == 24 ** -0.5 and cfg.embedding_multiplier == 64 ** 0.5


@pytest.mark.parametrize("length", [WINDOW - 1, WINDOW + 1, 2 * BLOCK, 3 * BLOCK + 5])
@pytest.mark.parametrize("attention", ["kernel", "reference"])
def test_gemma3_matches_hf(gemma3_dir, length, attention, monkeypatch):
    monkeypatch.setenv("PAGEDKV_ATTENTION", attention)
    model = LlamaModel(load_model_config(gemma3_dir), load_state_dict(gemma3_dir))
    ids = torch.randint(0, 49152, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    ref = hf_logits(gemma3_dir, ids)
    head = [WINDOW - 1, 1, 1, BLOCK - WINDOW + 3]
    for chunks in ([length], [1] * length, head + [length - sum(head)] if length > sum(head) else [length]):
        diff = (paged_logits(model, ids, chunks) - ref).abs().max().item()
        assert diff < TOL, f"chunks {chunks[:5]}...: max |logit diff| {diff:.2e} vs HF"


def test_dropping_any_gemma3_extra_breaks_the_match(gemma3_dir):
    """Each extra changes the logits on this model: a check that the test above can fail."""
    from dataclasses import replace

    cfg = load_model_config(gemma3_dir)
    ids = list(range(100, 100 + 2 * BLOCK))
    ref = hf_logits(gemma3_dir, ids)
    for change in (dict(qk_norm=False), dict(local_rope_theta=None), dict(rope_scaling=None),
                   dict(layer_windows=())):
        model = LlamaModel(replace(cfg, **change), load_state_dict(gemma3_dir))
        assert (paged_logits(model, ids, [len(ids)]) - ref).abs().max().item() > 100 * TOL, change


def test_the_engine_generates_hfs_greedy_tokens_past_the_window(gemma3_dir):
    from pagedkv import LLM, SamplingParams

    ids = list(range(1000, 1000 + WINDOW + 5))
    llm = LLM(model=str(gemma3_dir), num_blocks=64, block_size=4, max_num_batched_tokens=8)
    got = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0].token_ids
    want = hf_greedy(gemma3_dir, ids, 20)
    assert got == want
    assert llm.engine.stats().blocks_freed_by_window > 0


def test_qwen3_matches_hf(tmp_path, default_model_files):
    """Qwen 3: Llama with per-head q/k RMS norms (plain weight, not Gemma's 1 + weight)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    model = Qwen3ForCausalLM(Qwen3Config(**(TINY_CONFIG | dict(head_dim=16)))).float()
    folder = _save(model, tmp_path / "qwen3", default_model_files)
    cfg = load_model_config(folder)
    assert cfg.qk_norm and cfg.architecture == "Qwen3ForCausalLM" and not cfg.qkv_bias
    ids = list(range(300, 300 + 2 * BLOCK + 3))
    ref = hf_logits(folder, ids)
    ours = LlamaModel(cfg, load_state_dict(folder))
    for chunks in ([len(ids)], [BLOCK - 1, BLOCK + 2, 1, 1]):
        assert (paged_logits(ours, ids, chunks) - ref).abs().max().item() < TOL
    from dataclasses import replace

    plain = LlamaModel(replace(cfg, qk_norm=False), load_state_dict(folder))
    assert (paged_logits(plain, ids, [len(ids)]) - ref).abs().max().item() > 100 * TOL


def test_gemma3_1b_layers_cut_into_equal_groups():
    """22 window and 4 full layers: groups of gcd(22, 4) = 2 layers, in model order."""
    from pagedkv.kv.groups import (
        FullAttentionSpec,
        SlidingWindowSpec,
        group_layers,
        hybrid_page_layers,
        shared_page_slots,
    )
    from pagedkv.planner.models import load_model

    windows = load_model("gemma-3-1b").layer_windows
    assert hybrid_page_layers(windows) == 2
    full, slide = FullAttentionSpec(16), SlidingWindowSpec(16, sliding_window=512)
    groups = group_layers([full if w is None else slide for w in windows], 2)
    assert len(groups) == 13 and all(len(g.layer_ids) == 2 for g in groups)
    assert [g.layer_ids for g in groups if g.spec == full] == [(5, 11), (17, 23)]
    assert [g.layer_ids for g in groups][:3] == [(0, 1), (2, 3), (4, 6)]
    assert shared_page_slots(groups)[:8] == (0, 1, 0, 1, 0, 0, 1, 0)  # (7, 8) is a group
    with pytest.raises(ValueError, match="does not divide"):
        group_layers([full if w is None else slide for w in windows], 4)


def test_five_to_one_pages_hold_the_planners_bytes_and_give_hfs_tokens(gemma3_dir):
    """Seven window layers and one full: eight one-layer groups sharing one page slot, so a
    window layer's pages go back as its window slides; the most pages held while decoding
    equal ``paged_bytes_for_tokens`` (a prefill chunk briefly holds a window plus the chunk in
    every window group: admission counts that) and the greedy tokens equal HF's, alone and
    beside another request in a pool too small for both at full size."""
    from pagedkv import LLM, SamplingParams

    ids = list(range(2000, 2060))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(gemma3_dir), num_blocks=90, block_size=4, max_num_batched_tokens=8,
              enable_prefix_caching=False)
    eng, held = llm.engine, []
    assert [g.layer_ids for g in eng.kv_manager.kv_groups] == [(i,) for i in range(8)]
    assert eng.parts.kv_cache.layer_slots == (0,) * 8 and eng.parts.kv_spec.page_layers == 1
    step = eng.step
    eng.step = lambda: (held.append(eng.kv_manager.usage().used), step())[1]
    got = llm.generate([{"prompt_token_ids": ids}], params)[0].token_ids
    spec = eng.parts.kv_spec
    decoding = held[-(20 - 2):]  # (60 prompt tokens in 8-token chunks, then 20 decode steps)
    assert max(decoding) * spec.page_size_bytes == spec.paged_bytes_for_tokens(len(ids) + 20 - 1)
    assert max(decoding) < spec.blocks_for_tokens(len(ids) + 20) * 8 / 3  # vs every layer holding every token
    want = hf_greedy(gemma3_dir, ids, 20)
    assert got == want
    both = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": list(range(3000, 3050))}], params)
    assert both[0].token_ids == want


def test_many_groups_under_prefix_hits_and_preemption_match_a_roomy_engine(gemma3_dir):
    """Eight groups' prefix hits, pins and preemptions in a tight pool (the invariant check
    runs every step, and slot_usage is held to its definition): the same tokens and
    log-probs as a roomy engine without caching."""
    import random

    from pagedkv import LLM, SamplingParams

    rng = random.Random(7)
    base = [rng.randrange(49152) for _ in range(40)]
    prompts = [{"prompt_token_ids": base[:k] if i % 2 else [rng.randrange(49152) for _ in range(k)]}
               for i, k in enumerate(rng.choice([1, 3, 4, 11, 12, 13, 16, 24, 33]) for _ in range(10))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    from test_bench_metrics import _slot_usage_by_slot

    tight = LLM(model=str(gemma3_dir), block_size=4, batch_invariant=True, num_blocks=70, max_num_batched_tokens=8,
                debug_invariants=True)
    eng, checked = tight.engine, []
    step = eng.step

    def step_and_check_slot_usage():  # the fast slot_usage against its per-slot definition, on real tables
        out = step()
        kv, written = eng.kv_manager, {r.request_id: r.num_computed_tokens for r in eng.scheduler.running}
        want = _slot_usage_by_slot([g.block_tables for g in kv.groups], written, 4, kv.pool.null_block)
        assert kv.slot_usage(written) == want
        checked.append(want[0] > 0)
        return out
    eng.step = step_and_check_slot_usage
    got = tight.generate(prompts, params)
    assert sum(checked) > 50
    stats = tight.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0 and stats.blocks_freed_by_window > 0
    roomy = LLM(model=str(gemma3_dir), block_size=4, batch_invariant=True, num_blocks=1024,
                enable_prefix_caching=False)
    for a, b in zip(got, roomy.generate(prompts, params)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_the_planner_counts_every_page_where_the_engine_keeps_one_group(gemma3_dir):
    """With an offload tier the engine keeps one full-attention group (window layers give
    nothing back): the planner's paged bytes per request and requests that fit say so, and
    equal what the engine holds (found by a break-it pass: the plan counted the windows'
    savings, about 5x too many requests for Gemma 3 27B)."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.planner.plan import plan

    hybrid = plan(model=str(gemma3_dir), seq_len=79, block_size=4, kv_cache_memory="1MiB")
    tier = plan(model=str(gemma3_dir), seq_len=79, block_size=4, kv_cache_memory="1MiB", kv_offload_memory="1MiB")
    assert hybrid.windows_free_pages and not tier.windows_free_pages
    assert tier.paged_bytes_per_request == 20 * 4 * tier.bytes_per_token  # every layer, every block
    assert hybrid.max_concurrent_requests > 3 * tier.max_concurrent_requests
    llm = LLM(model=str(gemma3_dir), block_size=4, num_blocks=64, kv_offload_memory="1MiB")
    eng, held = llm.engine, []
    step = eng.step
    eng.step = lambda: (held.append(eng.kv_manager.usage().used), step())[1]
    llm.generate([{"prompt_token_ids": list(range(2000, 2060))}],
                 SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert max(held) * eng.parts.kv_spec.page_size_bytes == tier.paged_bytes_per_request_per_device


def test_hybrid_limits_name_the_cache(gemma3_dir):
    """A pool too small for a one-token request in all eight groups is refused when the
    engine is built; a request over the cache-set max_model_len is told the cache set it."""
    from pagedkv import LLM, SamplingParams

    with pytest.raises(ValueError, match="cannot hold a one-token request, which needs 8"):
        LLM(model=str(gemma3_dir), block_size=4, num_blocks=7)
    llm = LLM(model=str(gemma3_dir), block_size=4, num_blocks=64)
    limit = llm.engine.max_model_len
    assert limit < 512  # the model's own positions
    with pytest.raises(ValueError, match=rf"max_model_len \({limit}, the most one request can hold in the whole KV "
                                         r"cache: 64 blocks of 4 tokens\)"):
        llm.engine.add_request({"prompt_token_ids": list(range(limit - 5))}, SamplingParams(max_tokens=16))
