"""Sliding-window models (issue 14, first step): Mistral- and Qwen2-shaped tiny random
models with windows shorter than the prompt, against HF transformers' own models, through
whole prefill, chunked prefill across the window edge and decode past the window, with the
fused kernel and the pure-torch reference; and the engine running them past the window."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import TINY_CONFIG
from test_forward_vs_hf import BLOCK, TOL, hf_logits, paged_logits

from pagedkv.model.llama import LlamaModel
from pagedkv.model.loader import load_model_config, load_state_dict

WINDOW = 12


def save_random(model, folder, tokenizer_from, std: float = 0.1, vector_std: float | None = None):
    """``model`` with weights redrawn from N(0, std) (vectors: ``vector_std``, default std),
    saved to ``folder`` with the real SmolLM2 tokenizer files from ``tokenizer_from``."""
    with torch.no_grad():  # HF inits small; widen so attention patterns are not uniform
        for p in model.parameters():
            p.normal_(0, std if p.dim() > 1 or vector_std is None else vector_std)
    model.save_pretrained(str(folder))
    for f in tokenizer_from.iterdir():  # the real SmolLM2 tokenizer, for the engine
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, default_model_files):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(11)
    cfg = MistralConfig(**(TINY_CONFIG | {"sliding_window": WINDOW}))
    return save_random(MistralForCausalLM(cfg).float(), tmp_path_factory.mktemp("mistral"),
                       default_model_files.folder)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, default_model_files):
    """Layer 0 full attention, layer 1 sliding (max_window_layers = 1)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(12)
    cfg = Qwen2Config(**(TINY_CONFIG | {"sliding_window": WINDOW, "use_sliding_window": True,
                                        "max_window_layers": 1}))
    return save_random(Qwen2ForCausalLM(cfg).float(), tmp_path_factory.mktemp("qwen2"),
                       default_model_files.folder)


def schedules(n: int) -> dict[str, list[int]]:
    """Whole prefill; chunks ending just before, at and after the window edge and block
    edges, then decodes; all decodes."""
    head = [WINDOW - 1, 1, 1, BLOCK - WINDOW + 3]
    rest = n - sum(head) - 5
    return {"whole": [n], "chunked": head + [rest] + [1] * 5, "decode": [1] * n}


@pytest.mark.parametrize("length", [WINDOW - 1, WINDOW, WINDOW + 1, 2 * BLOCK, 3 * BLOCK + 5])
@pytest.mark.parametrize("attention", ["kernel", "reference"])
def test_mistral_sliding_window_matches_hf(mistral_dir, length, attention, monkeypatch):
    monkeypatch.setenv("PAGEDKV_ATTENTION", attention)
    cfg = load_model_config(mistral_dir)
    assert cfg.layer_windows == (WINDOW, WINDOW)
    model = LlamaModel(cfg, load_state_dict(mistral_dir))
    ids = torch.randint(0, 49152, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    ref = hf_logits(mistral_dir, ids)
    for name, chunks in schedules(length).items():
        if sum(chunks) != length or min(chunks) < 1:
            chunks = [length]
        diff = (paged_logits(model, ids, chunks) - ref).abs().max().item()
        assert diff < TOL, f"{name}: max |logit diff| {diff:.2e} vs HF"


def test_qwen2_mixed_full_and_window_layers_match_hf(qwen2_dir):
    cfg = load_model_config(qwen2_dir)
    assert cfg.layer_windows == (None, WINDOW)
    model = LlamaModel(cfg, load_state_dict(qwen2_dir))
    assert [layer.window for layer in model.layers] == [0, WINDOW]
    ids = torch.randint(0, 49152, (45,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_logits(qwen2_dir, ids)
    for name, chunks in schedules(45).items():
        diff = (paged_logits(model, ids, chunks) - ref).abs().max().item()
        assert diff < TOL, f"{name}: max |logit diff| {diff:.2e} vs HF"


def test_the_window_matters(mistral_dir):
    """The same weights without the window give other logits past it: the tests above would
    fail if the window were ignored."""
    cfg = load_model_config(mistral_dir)
    model = LlamaModel(cfg, load_state_dict(mistral_dir))
    for layer in model.layers:
        layer.window = 0
    ids = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    diff = (paged_logits(model, ids, [30]) - hf_logits(mistral_dir, ids)).abs()
    assert diff[:WINDOW].max() < TOL and diff[WINDOW:].max() > 100 * TOL


def test_engine_generates_past_the_window_as_hf_does(mistral_dir):
    """max_model_len is no longer capped at the window; greedy tokens equal HF's generate."""
    from transformers import AutoModelForCausalLM

    from pagedkv import LLM, SamplingParams

    llm = LLM(model=str(mistral_dir), num_blocks=64)
    assert llm.engine.max_model_len == TINY_CONFIG["max_position_embeddings"]
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0.0,
                                                                       ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(mistral_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, 20:]
    assert out.token_ids == want.tolist()


def hf_greedy(folder, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_pages_before_the_window_go_back_and_output_is_unchanged(mistral_dir):
    """Block size 4, window 12: a request holds at most ceil(11 / 4) + 1 = 4 pages after each
    step (+ what the next step computes), the rest of its table is the null page, and the
    greedy tokens still equal HF's."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.kv.single_type import SlidingWindowManager

    llm = LLM(model=str(mistral_dir), num_blocks=64, block_size=4, debug_invariants=True,
              enable_prefix_caching=False)
    eng = llm.engine
    mgr = eng.kv_manager.groups[0]
    assert isinstance(mgr, SlidingWindowManager) and mgr.window == WINDOW
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
                    request_id="r")
    held, tokens = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens = out.token_ids
        table = mgr.block_tables.get("r")
        if table:
            held.append(sum(b != eng.kv_manager.pool.null_block for b in table))
    assert tokens == hf_greedy(mistral_dir, prompt, 30)
    assert max(held[1:]) <= -(-(WINDOW - 1) // 4) + 2 and mgr.blocks_given_back >= 7
    assert eng.stats().blocks_freed_by_window == mgr.blocks_given_back
    assert eng.kv_manager.usage().used == 0  # everything back after the request


def test_windows_keep_many_long_requests_in_a_small_pool(mistral_dir, monkeypatch):
    """Eight 60-token requests need 8 x 15 = 120 pages under full attention, which preempts
    in 48 pages; with the window they run in 48 pages, chunked, without preemption, each
    equal to its run alone."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.engine import parts as setup
    from pagedkv.kv.groups import single_group

    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(i)).tolist()}
               for i in range(8)]
    llm = LLM(model=str(mistral_dir), num_blocks=48, block_size=4, max_num_batched_tokens=16,
              debug_invariants=True, batch_invariant=True)
    together = llm.generate(prompts, params)
    assert all(o.num_preemptions == 0 for o in together)
    alone = LLM(model=str(mistral_dir), num_blocks=48, block_size=4, batch_invariant=True)
    for p, o in zip(prompts, together):
        assert alone.generate([p], params)[0].token_ids == o.token_ids
    monkeypatch.setattr(setup, "kv_groups", lambda config, cfg, draft: single_group(cfg.num_hidden_layers, 4))
    full = LLM(model=str(mistral_dir), num_blocks=48, block_size=4, max_num_batched_tokens=16, batch_invariant=True)
    outs = full.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in together]


def test_a_repeated_prompt_hits_the_prefix_cache(mistral_dir):
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=str(mistral_dir), num_blocks=64, block_size=4, debug_invariants=True)
    prompt = {"prompt_token_ids": torch.randint(0, 49152, (26,), generator=torch.Generator().manual_seed(5)).tolist()}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.num_cached_tokens >= 16 and second.token_ids == first.token_ids


@pytest.mark.parametrize("extra", ["cpu-tier", "swap", "contiguous", "draft"])
def test_features_that_read_whole_tables_keep_full_attention_groups(mistral_dir, extra):
    from pagedkv import LLM
    from pagedkv.kv.single_type import SlidingWindowManager

    kw = {"cpu-tier": dict(kv_offload_memory="16MiB"),
          "swap": dict(kv_offload_memory="16MiB", preemption_mode="swap"),
          "contiguous": dict(kv_allocator="contiguous"),
          "draft": dict(speculative_config={"model": str(mistral_dir), "num_speculative_tokens": 2})}[extra]
    llm = LLM(model=str(mistral_dir), num_blocks=64, **kw)
    assert not isinstance(llm.engine.kv_manager.groups[0], SlidingWindowManager)


def test_mixed_window_and_full_layers_keep_one_full_group(qwen2_dir):
    from pagedkv import LLM
    from pagedkv.kv.single_type import SlidingWindowManager

    llm = LLM(model=str(qwen2_dir), num_blocks=64)
    assert not isinstance(llm.engine.kv_manager.groups[0], SlidingWindowManager)


def test_planner_and_engine_agree_on_the_pages_a_window_request_holds(mistral_dir):
    """``pagedkv plan``'s paged bytes per request (a window straddles one extra block) is
    the most a long request holds in the engine after any decode step, and it is reached."""
    from pagedkv import LLM, SamplingParams, plan

    bs, seq_len = 4, 60
    result = plan(model=str(mistral_dir), block_size=bs, seq_len=seq_len, kv_cache_dtype="float32")
    llm = LLM(model=str(mistral_dir), num_blocks=64, block_size=bs, enable_prefix_caching=False)
    eng = llm.engine
    page_bytes = eng.parts.kv_spec.page_size_bytes
    assert result.paged_bytes_per_request == (-(-WINDOW // bs) + 1) * page_bytes
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(8)).tolist()
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=seq_len - 20, temperature=0.0,
                                                                  ignore_eos=True), request_id="r")
    held = []
    eng.step()  # the prefill holds the whole prompt while it computes it
    while eng.has_unfinished_requests():
        eng.step()
        table = eng.kv_manager.groups[0].block_tables.get("r", [])
        held.append(sum(b != eng.kv_manager.pool.null_block for b in table))
    assert max(held) * page_bytes == result.paged_bytes_per_request


def test_a_hit_survives_the_eviction_of_a_long_prompts_early_pages(mistral_dir):
    """Other requests evict the early pages of a 56-token prompt (its first, least recently
    used ones); a window needs only the last pages, so the repeat still hits and its tokens
    equal a fresh engine's. Under full attention's leading-run lookup the hit would be 0."""
    from pagedkv import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = lambda seed, n: {"prompt_token_ids": torch.randint(  # noqa: E731
        0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()}
    a = ids(100, 56)
    llm = LLM(model=str(mistral_dir), num_blocks=48, block_size=4, debug_invariants=True)
    first = llm.generate([a], params)[0]
    for seed, n in ((0, 56), (1, 56), (2, 20)):  # 16 + 16 + 7 pages: the last few must evict
        llm.generate([ids(seed, n)], params)
    mgr = llm.engine.kv_manager.groups[0]
    probe = type("R", (), {"request_id": "probe", "all_token_ids": a["prompt_token_ids"], "cache_salt": None})()
    hashes = llm.engine.kv_manager.block_hashes(probe)
    assert mgr.pool.lookup((0, hashes[0]), tuple(a["prompt_token_ids"][:4])) is None  # page 0 was evicted
    again = llm.generate([a], params)[0]
    assert again.num_cached_tokens >= 4 * 4 and again.token_ids == first.token_ids
    fresh = LLM(model=str(mistral_dir), num_blocks=48, block_size=4).generate([a], params)[0]
    assert again.token_ids == fresh.token_ids


def test_a_window_request_may_be_longer_than_the_whole_cache(mistral_dir):
    """16 pages of 4 tokens (64 slots); chunks of at most 16 tokens: a request holds at most
    ceil((11 + 16) / 4) + 1 = 8 pages, so 40 + 60 tokens run, equal to HF's greedy tokens.
    Under full attention the same request is refused at once, naming the cache."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=str(mistral_dir), num_blocks=16, block_size=4, max_num_batched_tokens=16,
              debug_invariants=True)
    assert llm.engine.max_model_len == TINY_CONFIG["max_position_embeddings"]
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(21)).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=60, temperature=0.0,
                                                                       ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(mistral_dir, prompt, 60)
    full = LLM(model=str(mistral_dir), num_blocks=16, block_size=4, max_num_batched_tokens=16,
               kv_allocator="contiguous")
    assert full.engine.max_model_len == 64
    with pytest.raises(ValueError, match="whole KV cache"):
        full.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=60))
    small = LLM(model=str(mistral_dir), num_blocks=7, block_size=4, max_num_batched_tokens=16)
    assert small.engine.max_model_len == 28  # 8 pages would be needed: the whole cache caps it
