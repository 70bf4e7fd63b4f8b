"""Our paged forward equals HF transformers' LlamaForCausalLM (fp32, max |diff| < 1e-4):
whole prefill, chunked prefill and one-token decode steps, on shuffled (non-contiguous)
pages, for a tiny random model, a Qwen2-style biased one, and the real SmolLM2."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_folder

from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.kv_cache.storage import KVCacheStorage
from pagedkv.model.llama import LlamaModel
from pagedkv.model.loader import load_model_config, load_state_dict

BLOCK = 16
TOL = 1e-4


def paged_logits(model: LlamaModel, ids: list[int], chunks: list[int], dtype="float32") -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` computed chunk by chunk over a shuffled block table."""
    cfg = model.cfg
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype, BLOCK)
    nblocks = -(-len(ids) // BLOCK)
    storage = KVCacheStorage(spec, nblocks + 3)
    table = torch.randperm(nblocks + 3, generator=torch.Generator().manual_seed(1))[:nblocks]
    out, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)
        slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
        meta = AttentionMetadata(slots, [SeqAttention(0, n, start + n, table)])
        out.append(model.logits(model.forward(torch.tensor(ids[start:start + n]), pos, storage, meta)))
        start += n
    assert start == len(ids)
    return torch.cat(out)


def hf_logits(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def schedules(n: int) -> dict[str, list[int]]:
    prefill = n - 6
    return {"whole": [n],
            "chunked": [BLOCK - 1, BLOCK + 2, prefill - (2 * BLOCK + 1)] + [1] * 6,
            "decode": [1] * n}


def check_model(folder, ids):
    cfg = load_model_config(folder)
    model = LlamaModel(cfg, load_state_dict(folder))
    ref = hf_logits(folder, ids)
    for name, chunks in schedules(len(ids)).items():
        diff = (paged_logits(model, ids, chunks) - ref).abs().max().item()
        assert diff < TOL, f"{name}: max |logit diff| {diff:.2e} vs HF"


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False, "num_key_value_heads": 1},
                                       {"num_key_value_heads": 4, "rope_theta": 500000.0}],
                         ids=["gqa-tied", "mqa-untied", "mha"])
def test_tiny_random_llama_matches_hf(tmp_path, overrides):
    folder = make_hf_folder(tmp_path, seed=3, **overrides)
    ids = torch.randint(0, 49152, (53,), generator=torch.Generator().manual_seed(0)).tolist()
    check_model(folder, ids)


def test_qwen2_style_attention_bias_matches_hf(tmp_path):
    from conftest import TINY_CONFIG
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIG)).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(str(tmp_path))
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    check_model(tmp_path, ids)


@pytest.mark.slow
def test_default_model_matches_hf(default_model_files):
    from pagedkv.model.loader import load_tokenizer

    tok = load_tokenizer(default_model_files.folder)
    ids = tok("The paged KV cache stores keys and values in fixed-size blocks, so memory "
              "is allocated on demand and shared between requests with a common prefix. "
              "Decoding then reads every cached token of every layer at each step.").input_ids
    assert len(ids) > 2 * BLOCK + 7
    check_model(default_model_files.folder, ids)


@pytest.mark.slow
def test_gguf_conversion_matches_transformers_gguf_loader(default_model_files):
    """transformers' own GGUF loader dequantizes and un-permutes independently of ours."""
    from transformers import AutoModelForCausalLM

    from pagedkv.model.loader import _packaged_gguf

    gguf = _packaged_gguf("smollm2-135m-instruct")
    ref_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ids = [1780, 314, 260, 3575, 282, 4649, 314]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    cfg = default_model_files.config
    ours = paged_logits(LlamaModel(cfg, load_state_dict(default_model_files.folder)), ids, [len(ids)])
    assert (ours - ref).abs().max().item() < TOL
