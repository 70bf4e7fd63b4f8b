"""Weight-only int8 linear layers (issue 17, ``--weight-dtype int8``): the kernel against the
dequantized reference, its batch and thread invariance, the model against HF run on the
same dequantized weights, the engine's batch invariance and bytes, the CLI flag."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rows_invariant
from test_forward_vs_hf import BLOCK, paged_logits

from pagedkv import SamplingParams
from pagedkv.model.int8_weights import Int8Weight
from pagedkv.model.llama import LlamaModel, ModelSettings
from pagedkv.model.loader import load_model_config, load_state_dict


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (7, 40), (5, 48), (130, 64)],
                         ids=["qkv", "down", "odd-k", "k-mult-8", "n-tail"])
@pytest.mark.parametrize("m", [1, 3, 4, 17, 70])
def test_kernel_equals_the_dequantized_product(n, k, m):
    torch.manual_seed(n * k + m)
    w = Int8Weight.quantize(torch.randn(n, k))
    x, bias = torch.randn(m, k), torch.randn(n)
    ref = F.linear(x, w.dequantize(), bias)
    got = w(x, bias)
    assert got.shape == (m, n) and (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_a_row_alone_equals_the_row_in_any_batch_and_thread_count():
    """Batch-invariant by construction: no padding, no dependence on M or threads."""
    torch.manual_seed(0)
    w = Int8Weight.quantize(torch.randn(576, 576))
    x = torch.randn(37, 576)
    assert_rows_invariant(w, x)


def test_quantization_error_is_half_a_step_and_zero_rows_survive():
    w = torch.randn(64, 96)
    w[3] = 0.0
    q = Int8Weight.quantize(w)
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale[:, None] / 2 + 1e-7).all() and torch.equal(q.dequantize()[3], w[3])
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127 and q.nbytes == 64 * 96 + 4 * 64


@pytest.mark.filterwarnings("ignore:pagedkv. quantized weights without")
def test_reference_mode_computes_the_same_values(monkeypatch):
    torch.manual_seed(1)
    w = Int8Weight.quantize(torch.randn(100, 64))
    x = torch.randn(5, 64)
    kernel = w(x)
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    assert (w(x) - kernel).abs().max() <= 1e-5 * kernel.abs().max()


def test_int8_model_matches_hf_on_the_same_dequantized_weights(tiny_model_dir):
    """The engine's int8 forward equals HF's fp32 forward whose weights are the int8 values
    times their scales (LM head included), at every schedule."""
    from transformers import AutoModelForCausalLM

    cfg = load_model_config(tiny_model_dir)
    model = LlamaModel(cfg, load_state_dict(tiny_model_dir), ModelSettings(weight_dtype="int8"))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                mod.weight.copy_(Int8Weight.quantize(mod.weight).dequantize())
        # the LM head is tied to the embedding table, which stays fp32 for row lookups
        hf.lm_head.weight = torch.nn.Parameter(Int8Weight.quantize(hf.lm_head.weight).dequantize())
        ids = list(range(200, 200 + 3 * BLOCK + 5))
        ref = hf(torch.tensor([ids])).logits[0]
    for chunks in ([len(ids)], [BLOCK + 3, len(ids) - BLOCK - 3 - 4, 1, 1, 1, 1]):
        assert (paged_logits(model, ids, chunks) - ref).abs().max() < 1e-4


def test_int8_engine_is_batch_invariant_and_reads_a_quarter_of_the_bytes(tiny_llm_factory):
    fp32, int8 = tiny_llm_factory(num_blocks=64), tiny_llm_factory(num_blocks=64, weight_dtype="int8")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = ["a b c d", "the paged cache", "one more prompt here", "x"]
    alone = int8.generate([prompts[1]], params)[0]
    batch = int8.generate(prompts, params)[1]
    assert alone.token_ids == batch.token_ids and alone.logprobs == batch.logprobs
    layers = [t for layer in int8.engine.model.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(t, Int8Weight) for t in layers) and isinstance(int8.engine.model.lm_head, Int8Weight)
    assert int8.engine.model.weight_bytes < 0.3 * fp32.engine.model.weight_bytes


def test_weight_dtype_is_a_flag_and_refuses_unknown_values(tiny_model_dir):
    run = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(tiny_model_dir), "--num-blocks", "16",
           "--max-tokens", "3", "--no-chat", "--json", "--weight-dtype", "int8", "hello"]
    r = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[0])["token_ids"]) == 3
    r = subprocess.run(run[:-2] + ["int3", "hello"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "weight-dtype" in r.stderr


def test_engine_and_planner_agree_on_int8_weight_bytes(default_model_files):
    """The planner counts every parameter at 1 byte; the engine adds fp32 per-channel scales
    and norms (0.7% here) and leaves out the fp32 embedding table it only looks rows up in."""
    from pagedkv.planner.plan import plan

    model = LlamaModel(default_model_files.config, load_state_dict(default_model_files.folder),
                       ModelSettings(weight_dtype="int8"))
    planned = plan(weight_dtype="int8").weight_bytes
    assert abs(model.weight_bytes / planned - 1) < 0.01
    assert abs(plan(weight_dtype="float32").weight_bytes / (4 * planned) - 1) < 1e-9


# ---- a break-it pass's findings ------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_not_rounded_away(bad):
    """A NaN row got scale 1 (NaN > 0 is False) and its weights were rounded to integers:
    the int8 engine answered with wrong text where the fp32 one aborted."""
    w = torch.randn(8, 32)
    w[3, 5] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        Int8Weight.quantize(w)


@pytest.mark.parametrize("k", [1544, 1540, 37])
def test_widths_that_are_not_a_vector_multiple_take_the_vector_path_with_a_scalar_tail(k):
    torch.manual_seed(k)
    w = Int8Weight.quantize(torch.randn(96, k))
    x = torch.randn(5, k)
    ref = F.linear(x, w.dequantize())
    full = w(x)
    assert (full - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert all(torch.equal(w(x[i:i + 1]), full[i:i + 1]) for i in range(5))


def test_the_fallback_is_batch_invariant_in_that_mode(monkeypatch):
    """Without the kernel, products run through the model's fp32 linear function, so
    batch-invariant mode pads them as it pads fp32 weights."""
    from pagedkv.model import int8_weights
    from pagedkv.numerics import linear_for

    monkeypatch.setattr(int8_weights, "_state", {})  # the warning is once per process
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    torch.manual_seed(3)
    w = Int8Weight.quantize(torch.randn(200, 64))
    x = torch.randn(23, 64)
    with pytest.warns(RuntimeWarning, match="quantized weights without their kernel"):
        linear_for(True)(x[:1], w)
    full = linear_for(True)(x, w)
    assert all(torch.equal(linear_for(True)(x[i:i + 1], w), full[i:i + 1]) for i in range(23))
