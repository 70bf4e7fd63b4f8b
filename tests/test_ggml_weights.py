"""GGML block weights kept quantized (issue 17, ``--weight-dtype auto|int4``): the kernel
against gguf-py's dequantized values, bit-exact widening, batch and thread invariance, the
default GGUF's blocks loaded byte for byte, the model against HF on the same weights, the
engine's bytes against the planner's per-format arithmetic, and the flags."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import assert_rows_invariant
from test_forward_vs_hf import BLOCK, paged_logits

from pagedkv import SamplingParams
from pagedkv.model.ggml_weights import FORMATS, Q4_1, Q8_0, GGMLWeight
from pagedkv.model.llama import LlamaModel, ModelSettings
from pagedkv.model.loader import load_model_config, load_state_dict

FMTS = pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])


@FMTS
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (7, 64), (130, 32)], ids=["qkv", "down", "n7", "n-tail"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 17])
def test_kernel_equals_the_dequantized_product(qtype, n, k, m):
    torch.manual_seed(n * k + m)
    w = GGMLWeight.quantize(torch.randn(n, k), qtype)
    x, bias = torch.randn(m, k), torch.randn(n)
    ref = x.double() @ w.dequantize().double().T + bias.double()
    got = w(x, bias)
    assert got.shape == (m, n) and (got.double() - ref).abs().max() <= 2e-6 * ref.abs().max()


@FMTS
def test_the_kernel_widens_each_block_to_exactly_gguf_pys_values(qtype):
    """One-hot activations pick single weights: every widened value equals gguf-py's
    dequantized fp32 bit for bit (d * q, then + m, each rounded once)."""
    torch.manual_seed(2)
    w = GGMLWeight.quantize(torch.randn(40, 96) * 3, qtype)
    assert torch.equal(w(torch.eye(96)), w.dequantize().T.contiguous())


@FMTS
def test_a_row_alone_equals_the_row_in_any_batch_and_thread_count(qtype):
    torch.manual_seed(0)
    w = GGMLWeight.quantize(torch.randn(576, 576), qtype)
    x = torch.randn(37, 576)
    assert_rows_invariant(w, x)


@FMTS
def test_every_row_count_gives_a_row_the_bits_it_has_alone(qtype):
    """1-13 activation rows cover each few-row blocking (whole tiles of four, a last tile
    of two or three, single rows, the many-rows path) and a last panel of 3 weight rows."""
    torch.manual_seed(3)
    w = GGMLWeight.quantize(torch.randn(131, 320), qtype)
    x = torch.randn(13, 320)
    alone = torch.cat([w(x[i:i + 1]) for i in range(13)])
    for m in range(2, 14):
        assert torch.equal(w(x[:m]), alone[:m]), m


@pytest.mark.filterwarnings("ignore:pagedkv. quantized weights without")
def test_reference_mode_computes_the_same_values(monkeypatch):
    torch.manual_seed(1)
    w = GGMLWeight.quantize(torch.randn(100, 64), Q4_1)
    x = torch.randn(5, 64)
    kernel = w(x)
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    assert (w(x) - kernel).abs().max() <= 1e-5 * kernel.abs().max()


def test_bad_blocks_and_widths_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        GGMLWeight.quantize(torch.randn(4, 40), Q4_1)
    with pytest.raises(ValueError, match="NaN or infinite"):
        GGMLWeight.quantize(torch.full((4, 32), float("inf")), Q8_0)
    with pytest.raises(ValueError, match="do not hold rows"):
        GGMLWeight(torch.zeros(4, 21, dtype=torch.uint8), Q4_1, 32)
    with pytest.raises(ValueError, match="ggml type 2"):
        GGMLWeight(torch.zeros(4, 18, dtype=torch.uint8), 2, 32)


def test_the_default_gguf_loads_its_own_blocks_byte_for_byte(default_model_files):
    """``auto`` keeps the file's Q4_1/Q8_0 bytes (Q/K rows un-permuted like the fp32
    conversion), and they stand for exactly the converted folder's fp32 weights."""
    from gguf import GGUFReader

    from pagedkv.model.gguf_convert import read_blocks, unpermute_rows

    blocks = read_blocks(default_model_files.gguf_path)
    assert {w.format for w in blocks.values()} == {"Q4_1", "Q8_0"} and len(blocks) == 211
    raw = {t.name: t for t in GGUFReader(str(default_model_files.gguf_path)).tensors}
    assert torch.equal(blocks["model.layers.3.mlp.down_proj.weight"].blocks,
                       torch.from_numpy(np.array(raw["blk.3.ffn_down.weight"].data)))
    heads = default_model_files.config.num_key_value_heads
    assert torch.equal(blocks["model.layers.0.self_attn.k_proj.weight"].blocks,
                       torch.from_numpy(unpermute_rows(np.array(raw["blk.0.attn_k.weight"].data), heads).copy()))
    state = load_state_dict(default_model_files.folder)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.gate_proj.weight"):
        assert torch.equal(blocks[name].dequantize(), state[name]), name


def test_int4_model_matches_hf_on_the_same_dequantized_weights(tiny_model_dir):
    """``int4`` on an fp32 folder: Q4_1 layers and a Q8_0 LM head, quantized at load; the
    forward equals HF's over the dequantized values, at every schedule."""
    from transformers import AutoModelForCausalLM

    cfg = load_model_config(tiny_model_dir)
    model = LlamaModel(cfg, load_state_dict(tiny_model_dir), ModelSettings(weight_dtype="int4"))
    assert model.layers[0].gate_up.format == "Q4_1" and model.lm_head.format == "Q8_0"
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                mod.weight.copy_(GGMLWeight.quantize(mod.weight, Q4_1).dequantize())
        hf.lm_head.weight = torch.nn.Parameter(GGMLWeight.quantize(hf.lm_head.weight, Q8_0).dequantize())
        ids = list(range(200, 200 + 3 * BLOCK + 5))
        ref = hf(torch.tensor([ids])).logits[0]
    for chunks in ([len(ids)], [BLOCK + 3, len(ids) - BLOCK - 3 - 4, 1, 1, 1, 1]):
        assert (paged_logits(model, ids, chunks) - ref).abs().max() < 1e-4


def test_auto_on_a_float_folder_keeps_fp32(tiny_llm_factory):
    llm = tiny_llm_factory(weight_dtype="auto")
    assert all(isinstance(layer.qkv, torch.Tensor) for layer in llm.engine.model.layers)


@pytest.fixture(scope="module")
def auto_and_fp32(default_model_files):
    from pagedkv import LLM

    return (LLM(weight_dtype="auto", kv_cache_memory="64MiB"), LLM(weight_dtype="float32", kv_cache_memory="64MiB"))


def test_auto_runs_the_default_model_on_its_blocks_like_fp32(auto_and_fp32):
    """Same weights, another summation order: the same greedy tokens and log-probs within
    1e-3, and batch-invariant."""
    from pagedkv.model.weight_formats import describe

    auto, fp32 = auto_and_fp32
    assert describe(auto.engine.model) == "Q4_1 x 120, Q8_0 x 1"
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    got, ref = auto.generate(prompts, params), fp32.generate(prompts, params)
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids
        diffs = [abs(a[t] - b[t]) for a, b, t in zip(g.logprobs, r.logprobs, g.token_ids)]
        assert max(diffs) < 1e-3, diffs
    alone = auto.generate([prompts[1]], params)[0]
    assert alone.token_ids == got[1].token_ids and alone.logprobs == got[1].logprobs


def test_engine_and_planner_agree_on_block_weight_bytes(auto_and_fp32):
    """Per step: the layers' parameters at Q4_1's 20 bytes per 32, the tied LM head at Q8_0's
    34, the norms in fp32; the planner's format table says the same."""
    from pagedkv.planner.dtypes import WEIGHT_DTYPE_BYTES
    from pagedkv.planner.models import load_model
    from pagedkv.planner.params import count_params, norm_params

    m = load_model("smollm2-135m-instruct")
    c = count_params(m)
    norms = (m.norms_per_layer * m.num_hidden_layers + 1) * norm_params(m)
    planned = ((c.total - c.embedding - norms) * WEIGHT_DTYPE_BYTES["q4_1"] + c.embedding * WEIGHT_DTYPE_BYTES["q8_0"]
               + norms * WEIGHT_DTYPE_BYTES["float32"])
    assert WEIGHT_DTYPE_BYTES["q4_1"] == FORMATS[Q4_1][1] / 32 and WEIGHT_DTYPE_BYTES["q8_0"] == FORMATS[Q8_0][1] / 32
    assert auto_and_fp32[0].engine.model.weight_bytes == planned


@pytest.mark.parametrize("dtype", ["auto", "int4"])
def test_weight_dtypes_are_flags(dtype, tiny_model_dir):
    run = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(tiny_model_dir), "--num-blocks", "16",
           "--max-tokens", "3", "--no-chat", "--json", "--weight-dtype", dtype, "hello"]
    r = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[0])["token_ids"]) == 3


def test_the_blocks_are_cached_beside_the_conversion_and_a_bad_cache_is_reparsed(default_model_files, tmp_path):
    from pagedkv.model.gguf_convert import BLOCKS_FILE, read_blocks

    parsed = read_blocks(default_model_files.gguf_path, tmp_path)
    assert (tmp_path / BLOCKS_FILE).exists()
    cached = read_blocks(default_model_files.gguf_path, tmp_path)
    assert cached.keys() == parsed.keys()
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert cached[name].qtype == parsed[name].qtype and torch.equal(cached[name].packed, parsed[name].packed)
    (tmp_path / BLOCKS_FILE).write_bytes(b"\x00garbage")
    again = read_blocks(default_model_files.gguf_path, tmp_path)
    assert torch.equal(again["model.layers.0.mlp.up_proj.weight"].packed,
                       parsed["model.layers.0.mlp.up_proj.weight"].packed)


def test_the_fp32_copies_of_kept_blocks_are_never_loaded(default_model_files):
    from pagedkv.model.loader import load_state_dict

    skip = {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"}
    state = load_state_dict(default_model_files.folder, skip=skip)
    assert not skip & set(state) and "model.layers.0.mlp.up_proj.weight" in state


def test_weights_a_block_scale_cannot_hold_and_non_byte_blocks_are_refused():
    w = torch.zeros(2, 32)
    w[0, 0] = 1e7
    with pytest.raises(ValueError, match="overflows fp16"):
        GGMLWeight.quantize(w, Q8_0)
    with pytest.raises(ValueError, match="uint8"):
        GGMLWeight(torch.zeros(2, 20, dtype=torch.int64), Q4_1, 32)
    good = GGMLWeight.quantize(torch.randn(4, 64), Q4_1)
    with pytest.raises(RuntimeError, match="x has 32 features per row but the weight rows have 64"):
        good(torch.randn(3, 32))


def test_int4_on_widths_that_are_not_multiples_of_32_names_the_layer(tmp_path, default_model_files):
    from conftest import make_hf_folder

    folder = make_hf_folder(tmp_path / "w48", tokenizer_from=default_model_files.folder, hidden_size=48,
                            num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"int4: model\.layers\.0\.self_attn\.q_proj\.weight: .*multiple of 32"):
        LlamaModel(load_model_config(folder), load_state_dict(folder), ModelSettings(weight_dtype="int4"))
