"""GGML blocks times int8 activations (issue 17, ``--weight-dtype auto|int4 --activation-dtype
int8``, llama.cpp's CPU scheme): the kernel against the torch reference bit for bit, both
against exact arithmetic where the recipe has no rounding, the panel layout against the
file's values, batch and thread invariance, NaN rows, the engine (one-call layers equal the
per-op path, quality near the fp32-activation engine) and the flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import assert_engine_batch_invariant, assert_rows_invariant

from pagedkv import EngineConfig, SamplingParams
from pagedkv.model.ggml_a8 import GGMLA8Weight, quantize_activations, reference
from pagedkv.model.ggml_weights import Q4_1, Q8_0, GGMLWeight
from pagedkv.model.int8_weights import kernel_op

FMTS = pytest.mark.parametrize("qtype", [Q4_1, Q8_0], ids=["q4_1", "q8_0"])
SHAPES = pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (7, 64), (130, 32), (16, 96)],
                                 ids=["qkv", "down", "n7", "n-tail", "one-panel"])


def weight(n: int, k: int, qtype: int, seed: int = 0) -> GGMLA8Weight:
    torch.manual_seed(seed)
    return GGMLA8Weight(GGMLWeight.quantize(torch.randn(n, k), qtype))


@FMTS
@SHAPES
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 35, 70])
def test_kernel_equals_the_reference_bit_for_bit(qtype, n, k, m):
    w = weight(n, k, qtype, n * k + m)
    x = torch.randn(m, k) * 3
    got = w(x)
    assert got.shape == (m, n) and torch.equal(got, reference(w, x))


@FMTS
@SHAPES
def test_the_panels_hold_exactly_the_files_values(qtype, n, k):
    torch.manual_seed(1)
    g = GGMLWeight.quantize(torch.randn(n, k), qtype)
    w = GGMLA8Weight(g)
    assert torch.equal(w.dequantize(), g.dequantize())
    assert w.nbytes == g.nbytes == n * k // 32 * (20 if qtype == Q4_1 else 34)


@FMTS
def test_on_the_int8_grid_with_power_of_two_scales_the_product_is_exact(qtype):
    """Activations already integers in [-127, 127] with 127 in every block quantize to
    themselves (dx = 1), and weights whose blocks have power-of-two d and m make every
    product and sum exact: the result must equal the float64 product of the weights."""
    torch.manual_seed(4)
    n, k = 40, 128
    d = 2.0 ** -torch.randint(2, 6, (n, k // 32)).float()
    q = torch.randint(0, 16, (n, k)).float() if qtype == Q4_1 else torch.randint(-127, 128, (n, k)).float()
    q[:, ::32], q[:, 1::32] = (0.0, 15.0) if qtype == Q4_1 else (127.0, -127.0)  # each block's extremes
    m = -8 * d if qtype == Q4_1 else torch.zeros_like(d)
    exact = (q.view(n, -1, 32) * d[..., None] + m[..., None]).reshape(n, k)
    w = GGMLA8Weight(GGMLWeight.quantize(exact, qtype))
    assert torch.equal(w.dequantize(), exact)  # gguf-py found the same d, m and q
    x = torch.randint(-127, 128, (5, k)).float()
    x[:, ::32] = 127.0
    assert torch.equal(w(x).double(), x.double() @ exact.double().T)


@FMTS
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_the_largest_integer_sums_do_not_saturate(qtype, m):
    """Every weight at its largest size (Q4_1 nibbles 15, Q8_0 quants +-127) against
    activations of +-127: the AVX2 kernel's 16-bit lanes then hold their largest sums (a Q4_1
    block's 30,480 per lane, a Q8_0 pair's 32,258), which must stay exact."""
    torch.manual_seed(m)
    n, k = 48, 128
    if qtype == Q4_1:
        q = torch.full((n, k), 15.0)
        q[:, ::32] = 0.0  # each block's minimum, so that d = 1 and m = 0 are found again
    else:
        q = 127.0 * (torch.randint(0, 2, (n, k)).float() * 2 - 1)
    exact = q  # d = 1 (and m = 0): the weights are their quants
    w = GGMLA8Weight(GGMLWeight.quantize(exact, qtype))
    assert torch.equal(w.dequantize(), exact)
    x = torch.full((m, k), 127.0)
    x[1:] *= torch.randint(0, 2, (m - 1, k)).float() * 2 - 1  # row 0 all +127, the rest signed
    y = w(x)
    assert torch.equal(y, reference(w, x))
    assert torch.equal(y.double(), x.double() @ exact.double().T)


def test_activation_quantization_rounds_half_to_even_and_keeps_zero_blocks_finite():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 127.0, 2.5, 3.5, -2.5
    xq, dx, sq = quantize_activations(x)
    assert xq[0, 0, :4].tolist() == [127.0, 2.0, 4.0, -2.0] and dx[0].tolist() == [1.0, 1.0]
    assert sq[0].tolist() == [131.0, 0.0]


@FMTS
def test_the_kernel_rounds_activation_halves_to_even_and_caps_at_127(qtype):
    """Blocks whose largest value is 127 quantize with dx = 1, so values halfway between
    integers reach the rounding itself (half to even: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2); the
    kernel's vector quantizer must give the reference's integers, sums and results."""
    w = weight(40, 128, qtype, 7)
    torch.manual_seed(7)
    x = torch.randint(-126, 126, (6, 128)).float() + 0.5
    x[:, ::32] = 127.0
    x[1, 64:96] = 0.0  # an all-zero block: dx = 1, xq = 0
    x[2, 32:64] *= -1  # a block whose largest size is -127
    xq, dx, sq = quantize_activations(x)
    assert (xq[0, 0, 1:] % 2 == 0).all() and dx[1, 2] == 1.0 and sq[1, 2] == 0.0
    assert torch.equal(w(x), reference(w, x))
    assert torch.equal(w(x[3:4]), reference(w, x[3:4]))


@FMTS
def test_a_row_alone_equals_the_row_in_any_batch_and_thread_count(qtype):
    w = weight(576, 576, qtype)
    x = torch.randn(37, 576)
    assert_rows_invariant(w, x)


@FMTS
@pytest.mark.parametrize("m", [3, 40])  # 40: the two-panel tiles of 32 rows and more (AVX-512 VNNI)
def test_a_non_finite_activation_makes_only_its_row_nan(qtype, m):
    w = weight(48, 64, qtype)
    x = torch.randn(m, 64)
    x[1, 40] = float("inf")
    others = [i for i in range(m) if i != 1]
    for y in (w(x), reference(w, x)):
        assert torch.isnan(y[1]).all() and torch.isfinite(y[others]).all()


def test_close_to_the_fp32_product_of_the_same_weights():
    """The only rounding the recipe adds is the activations' 8 bits per 32 values."""
    g = GGMLWeight.quantize(torch.randn(576, 576), Q4_1)
    x = torch.randn(8, 576)
    ref = x.double() @ g.dequantize().double().T
    err = (GGMLA8Weight(g)(x).double() - ref).abs().max() / ref.abs().max()
    assert 1e-5 < err < 0.02


@pytest.mark.filterwarnings("ignore:pagedkv. quantized weights without")
def test_reference_mode_gives_the_kernels_bits(monkeypatch):
    w = weight(50, 256, Q4_1, 3)
    x = torch.randn(6, 256)
    fast = w(x)
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    assert kernel_op("ggml_a8_linear") is None
    assert torch.equal(w(x), fast)


def test_a_bad_packed_weight_is_refused_by_the_op():
    if kernel_op("ggml_a8_linear") is None:
        pytest.skip("the ggml_a8 kernel is built only for AVX2 CPUs (the torch reference path was checked)")
    w = weight(32, 64, Q4_1)
    with pytest.raises(RuntimeError, match="packed must be"):
        torch.ops.pagedkv.ggml_a8_linear(torch.randn(1, 96), w.packed, Q4_1, 32)
    with pytest.raises(RuntimeError, match="qtype must be"):
        torch.ops.pagedkv.ggml_a8_linear(torch.randn(1, 64), w.packed, 2, 32)


def test_float32_weights_refuse_int8_activations():
    with pytest.raises(ValueError, match="needs weight_dtype int8 .W8A8., auto or int4"):
        EngineConfig(weight_dtype="float32", activation_dtype="int8")


def test_int4_with_int8_activations_runs_and_fused_layers_equal_the_per_op_path(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=64, weight_dtype="int4", activation_dtype="int8")
    m = llm.engine.model
    assert all(isinstance(getattr(layer, n), GGMLA8Weight) for layer in m.layers
               for n in ("qkv", "o", "gate_up", "down")) and isinstance(m.lm_head, GGMLA8Weight)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = ["the paged cache", "one more prompt here"]
    fused = llm.generate(prompts, params)
    m.fused_layers = False
    per_op = llm.generate(prompts, params)
    for a, b in zip(fused, per_op):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_auto_on_a_folder_without_blocks_says_what_is_missing(tiny_llm_factory):
    with pytest.raises(ValueError, match="GGML Q4_1/Q8_0 blocks"):
        tiny_llm_factory(num_blocks=16, weight_dtype="auto", activation_dtype="int8")


def test_the_default_model_with_int8_activations_tracks_fp32_activations(default_model_files):
    """Teacher-forced over real text: the default GGUF's blocks with int8 activations give
    log-probs close to the same blocks with fp32 activations."""
    from pagedkv import LLM

    text = ("The KV cache stores the keys and values of every past token, so each new token costs "
            "a constant amount of projection work. Its size grows with the number of layers and tokens.")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    lps = []
    for act in ("float32", "int8"):
        llm = LLM(num_blocks=64, activation_dtype=act)
        lps.append(torch.tensor(llm.generate([text], params)[0].prompt_logprobs[1:]))
    fp, a8 = lps
    assert fp.shape == a8.shape and len(fp) > 30 and not torch.equal(fp, a8)
    assert abs(a8.mean() - fp.mean()) < 0.03 * abs(fp.mean())
    assert (a8 - fp).abs().median() < 0.2


def test_int8_activations_with_int4_weights_are_cli_flags(tiny_model_dir):
    run = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(tiny_model_dir), "--num-blocks", "16",
           "--max-tokens", "3", "--no-chat", "--json", "--weight-dtype", "int4", "--activation-dtype", "int8", "hi"]
    r = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[0])["token_ids"]) == 3
    r = subprocess.run(run[:-4] + ["float32", "--activation-dtype", "int8", "hi"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "needs weight_dtype int8" in r.stderr and "Traceback" not in r.stderr


def test_the_engine_is_batch_invariant_without_padding(tiny_llm_factory, monkeypatch):
    """Exact integer dots plus per-row float steps: the default engine (no --batch-invariant)
    gives a prompt the same tokens and log-probs alone and in a batch."""
    monkeypatch.setenv("PAGEDKV_BATCH_INVARIANT", "0")  # the suite turns it on for every engine
    llm = tiny_llm_factory(num_blocks=64, weight_dtype="int4", activation_dtype="int8", batch_invariant=False)
    assert_engine_batch_invariant(llm)
