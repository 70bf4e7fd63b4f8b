"""W8A8 linear layers (issue 17, ``--activation-dtype int8``): the kernel against the torch
path bit for bit, both against an independent float64 computation of the recipe, batch
invariance, SmoothQuant's identity, the engine's batch invariance and quality, the flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_engine_batch_invariant

from pagedkv import EngineConfig, SamplingParams
from pagedkv.model.int8_weights import kernel_op
from pagedkv.model.w8a8 import W8A8Weight, quantize_activations, smoothing

SHAPES = [(960, 576, 576), (576, 1536, 128), (37, 64, 16), (130, 64, 64), (16, 8, 4)]
SHAPE_IDS = ["qkv", "down-grouped", "n-tail", "two-panels-and-tail", "tiny"]


def expected(w: W8A8Weight, x: torch.Tensor) -> torch.Tensor:
    """The recipe computed independently: float64 quantization checks, int64 dots."""
    n, k = w.shape
    xs = x if w.inv_smooth is None else x * w.inv_smooth
    xg = xs.reshape(x.shape[0], k // w.group, w.group)
    amax = xg.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(xg / scale[..., None]).clamp(-127, 127).to(torch.int64)
    wq = w.q.to(torch.int64).reshape(n, k // w.group, w.group)
    isum = torch.einsum("mgk,ngk->mng", xq, wq)  # exact
    y = None
    for g in range(k // w.group):  # the documented order and roundings, in fp32
        part = isum[:, :, g].to(torch.float32) * scale[:, g:g + 1]
        y = part if y is None else y + part
    return y * w.w_scale


@pytest.mark.parametrize("n,k,group", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 17, 64])
def test_kernel_and_torch_path_equal_the_recipe_bit_for_bit(n, k, group, m):
    torch.manual_seed(n + k + m)
    w = W8A8Weight.quantize(torch.randn(n, k), torch.rand(k) + 0.5, group)
    x = torch.randn(m, k) * 3
    want = expected(w, x)
    assert torch.equal(w.reference(x), want)
    if kernel_op("w8a8_linear") is None:
        pytest.skip("the W8A8 kernel is built only for AVX2 CPUs (the torch path was checked)")
    assert torch.equal(w(x), want)


def test_a_row_alone_equals_the_row_in_any_batch():
    torch.manual_seed(0)
    w = W8A8Weight.quantize(torch.randn(576, 1536), None, 128)
    x = torch.randn(70, 1536)
    full, ref = w(x), w.reference(x)
    for i in (0, 3, 69):
        assert torch.equal(w(x[i:i + 1]), full[i:i + 1])
        assert torch.equal(w.reference(x[i:i + 1]), ref[i:i + 1])
    assert torch.equal(w(x[5:22]), full[5:22])


def test_smoothing_moves_scale_between_activations_and_weights_without_changing_the_product():
    torch.manual_seed(1)
    wt = torch.randn(96, 64)
    x = torch.randn(8, 64)
    x[:, 3] *= 60.0  # an outlier channel, as in real activations
    s = smoothing(x.abs().amax(0), wt)
    assert s[3] > 5 * s.median()  # the outlier channel is scaled down the most
    plain, smooth = W8A8Weight.quantize(wt), W8A8Weight.quantize(wt, s)
    assert (smooth.dequantize() - wt).abs().max() < 0.05 * wt.abs().max()
    exact = F.linear(x, wt)
    err = lambda w: ((w(x) - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(smooth) < 0.5 * err(plain)  # per-token scales: the outlier costs the rest of its row


def test_activation_quantization_rounds_half_to_even_and_keeps_zero_groups_finite():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, 0, 0, 0, 0]])
    q, s = quantize_activations(x, None, 4)
    assert s.tolist() == [[1.0, 1.0]]  # amax 127 -> scale 1; the all-zero group -> 1
    assert q.reshape(-1).tolist() == [127, 0, 2, -2, 0, 0, 0, 0]


def test_a_non_finite_activation_makes_its_row_nan_in_both_paths():
    """Not a silently clamped value: the row is NaN, as an fp32 product's would be; other rows
    are untouched."""
    torch.manual_seed(2)
    w = W8A8Weight.quantize(torch.randn(40, 64), None, 16)
    x = torch.randn(3, 64)
    clean = w(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        xb = x.clone()
        xb[1, 37] = bad
        for y in (w(xb), w.reference(xb)):
            assert torch.isnan(y[1]).all()
            assert torch.equal(y[0], clean[0]) and torch.equal(y[2], clean[2])


def test_bad_groups_and_weights_are_refused():
    with pytest.raises(ValueError, match="finite positive"):
        W8A8Weight.quantize(torch.randn(4, 8), torch.tensor([1.0, 0, 1, 1, 1, 1, 1, 1]))
    with pytest.raises(ValueError, match="float32 input"):
        W8A8Weight.quantize(torch.randn(4, 8))(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="multiple of 4 dividing"):
        W8A8Weight.quantize(torch.randn(4, 64), None, 48)
    with pytest.raises(ValueError, match="NaN or infinite"):
        W8A8Weight.quantize(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]))
    with pytest.raises(ValueError, match="weight_dtype int8"):
        EngineConfig(weight_dtype="float32", activation_dtype="int8")
    with pytest.raises(ValueError, match="activation_dtype must be one of"):
        EngineConfig(weight_dtype="int8", activation_dtype="int4")


def test_w8a8_engine_is_batch_invariant_without_padding(tiny_llm_factory, monkeypatch):
    """Every product is exact integers plus per-row float steps, so the default engine
    (no --batch-invariant) gives a prompt the same tokens and log-probs in any batch."""
    monkeypatch.setenv("PAGEDKV_BATCH_INVARIANT", "0")  # the suite turns it on for every engine
    llm = tiny_llm_factory(num_blocks=64, weight_dtype="int8", activation_dtype="int8", batch_invariant=False)
    assert_engine_batch_invariant(llm)
    m = llm.engine.model
    weights = [t for layer in m.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [m.lm_head]
    assert all(isinstance(t, W8A8Weight) for t in weights)
    assert m.layers[0].down.group == 128 and m.layers[0].qkv.inv_smooth is not None


def test_w8a8_tracks_float32_on_the_real_model(default_model_files):
    """Teacher-forced over a real sentence pair: log-probs close to the fp32 engine's."""
    from pagedkv import LLM

    text = ("The KV cache stores the keys and values of every past token, so each new token costs "
            "a constant amount of projection work. Its size grows with the number of layers and tokens.")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    lps = []
    for kw in ({"weight_dtype": "float32"}, {"weight_dtype": "int8", "activation_dtype": "int8"}):
        out = LLM(num_blocks=64, **kw).generate([text], params)[0]
        lps.append(torch.tensor(out.prompt_logprobs[1:]))
    fp32, w8a8 = lps
    assert fp32.shape == w8a8.shape and len(fp32) > 30
    assert abs(w8a8.mean() - fp32.mean()) < 0.03 * abs(fp32.mean())  # perplexity within ~3%
    assert (w8a8 - fp32).abs().median() < 0.2  # measured 0.11 nats per token


def test_activation_dtype_is_a_cli_flag(tiny_model_dir):
    run = [sys.executable, "-m", "pagedkv.cli", "generate", "--model", str(tiny_model_dir), "--num-blocks", "16",
           "--max-tokens", "3", "--no-chat", "--json", "--weight-dtype", "int8", "--activation-dtype", "int8", "hi"]
    r = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.splitlines()[0])["token_ids"]) == 3
    r = subprocess.run(run[:-6] + ["--activation-dtype", "int8", "hi"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "GGML Q4_1/Q8_0 blocks" in r.stderr and "Traceback" not in r.stderr


def test_reference_mode_gives_the_kernels_bits(monkeypatch):
    torch.manual_seed(3)
    w = W8A8Weight.quantize(torch.randn(50, 256), torch.rand(256) + 0.5, 128)
    x = torch.randn(6, 256)
    fast = w(x)
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    assert kernel_op("w8a8_linear") is None
    assert torch.equal(w(x), fast)
