"""The kernel library's small per-layer ops (``csrc/layer_ops.cpp``, issue 17 item 4)
against their torch composites: RoPE bit for bit, RMSNorm and SwiGLU within rounding, each
row independent of the others, and the torch fallback in reference mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.kernels.cpu.library import load_kernel
from pagedkv.model.layer_ops import rms_norm, silu_and_mul
from pagedkv.model.rope import RotaryEmbedding


@pytest.fixture(autouse=True, scope="module")
def kernel():
    load_kernel()


@pytest.mark.parametrize("t,d", [(1, 576), (7, 64), (33, 100), (2, 5)])
def test_rms_norm_matches_torch_and_each_row_is_alone(t, d):
    torch.manual_seed(t * d)
    x, w = torch.randn(t, d) * 5, torch.randn(d)
    got = torch.ops.pagedkv.rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x.double(), (d,), w.double(), 1e-5)
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(torch.ops.pagedkv.rms_norm(x[-1:].contiguous(), w, 1e-5), got[-1:])
    assert torch.equal(rms_norm(x, w, 1e-5), got)  # the model's function takes the op


def test_silu_and_mul_matches_torch():
    torch.manual_seed(3)
    x = torch.randn(9, 2 * 1536) * 6
    gate, up = x.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    got = silu_and_mul(x)
    assert got.shape == (9, 1536) and (got.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert torch.equal(torch.ops.pagedkv.silu_and_mul(x[4:5].contiguous()), got[4:5])



def test_silu_and_mul_at_the_edges_and_in_a_ragged_tail():
    """Rows whose length is not a multiple of the 8 lanes, large sizes either side (the
    exponential of one side underflows: below e^-87.3 the vector exp flushes to 0, while
    silu(g) times a large up is still a normal number), zeros and infinities: fp64's values, or the same
    infinities and NaNs as torch's float32 silu; a row alone equals the row in the batch."""
    g = torch.tensor([[-100.0, -88.0, -20.0, -1.0, -0.0, 0.0, 1e-8, 0.5, 20.0, 88.0, 100.0, 3.0, -3.0],
                      [float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 2.0, -2.0, 4.0, -4.0, 8.0, -8.0, 9.0,
                       -9.0],
                      [-87.4, -88.0, -88.0, -87.0, -88.5, -88.7, -86.0, -1.0, 1.0, -50.0, 50.0, -88.0, 0.0]])
    up = torch.cat([torch.linspace(-2, 2, 26).reshape(2, 13),  # then: silu(g) of ~1e-36 times a large up
                    torch.tensor([[1e30, 1e38, float("inf"), 1e36, -1e38, 1e38, 1e35, 1.0, 1.0, 1e20, 1.0, -3e38,
                                   1.0]])])
    got = torch.ops.pagedkv.silu_and_mul(torch.cat([g, up], -1))
    ref = F.silu(g.double()) * up.double()
    finite = torch.isfinite(ref)
    assert ((got.double() - ref).abs() <= 3e-7 * ref.abs() + 1e-30)[finite].all()
    assert torch.equal(got[~finite].isnan(), (F.silu(g) * up)[~finite].isnan())
    assert torch.equal(got[~finite].isinf(), (F.silu(g) * up)[~finite].isinf())
    alone = torch.ops.pagedkv.silu_and_mul(torch.cat([g, up], -1)[1:].contiguous())
    assert torch.equal(alone.view(torch.int32), got[1:].view(torch.int32))  # NaN bits included


@pytest.mark.parametrize("t", [1, 5, 40])
def test_rope_in_place_equals_the_composite_bit_for_bit(t):
    """On q/k heads viewed inside a fused qkv row (the model's layout: heads contiguous, rows strided)."""
    torch.manual_seed(t)
    rope = RotaryEmbedding(64, 4096, 10000.0, None)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (t,)))
    qkv = torch.randn(t, 960)
    ref = RotaryEmbedding.rotate(qkv[:, :768].view(t, 12, 64), cos, sin)
    view = qkv[:, :768].view(t, 12, 64)
    tail = qkv[:, 768:].clone()
    out = RotaryEmbedding.rotate_(view, cos, sin)
    assert out.data_ptr() == view.data_ptr() and torch.equal(out, ref) and torch.equal(qkv[:, 768:], tail)


def test_bad_inputs_are_refused():
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.pagedkv.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.pagedkv.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="tables must be"):
        torch.ops.pagedkv.rope_rotate_(torch.randn(2, 3, 8), torch.randn(2, 4), torch.randn(2, 4))


def test_reference_mode_uses_torch(monkeypatch):
    torch.manual_seed(5)
    x, w = torch.randn(3, 64), torch.randn(64)
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    assert torch.equal(rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))
    gate, up = torch.randn(3, 128).chunk(2, dim=-1)
    assert torch.equal(silu_and_mul(torch.cat([gate, up], -1)), F.silu(gate) * up)


def _argmax_cases(rows: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rows * vocab)
    cases = [torch.randn(rows, vocab, generator=g), torch.randint(-2, 2, (rows, vocab), generator=g).float()]
    bad = torch.randn(rows, vocab, generator=g)
    bad[0, torch.randint(0, vocab, (3,), generator=g)] = float("nan")
    bad[-1, torch.randint(0, vocab, (2,), generator=g)] = float("inf")
    cases.append(bad)
    cases.append(torch.full((rows, vocab), float("-inf")))
    edge = torch.full((rows, vocab), float("-inf"))
    edge[:, -1] = 3.0          # the maximum in the tail after the last whole chunk
    edge[0, 0] = float("nan")  # a NaN first
    cases.append(edge)
    late = torch.zeros(rows, vocab)
    late[:, vocab // 2:] = 1.0
    late[-1, -1] = float("nan")  # a NaN after the maximum
    cases.append(late)
    return cases


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (20, 1000), (3, 7), (2, 128), (4, 129), (9, 257)])
def test_greedy_argmax_is_torch_argmax(rows, vocab):
    """The one-pass greedy pick equals torch.argmax (first maximum on ties, first NaN, +inf,
    all -inf rows, tails past the last 128-float chunk) and flags non-finite picks; the
    sampler's helper gives the same on the kernel and in torch."""
    from pagedkv.worker.sampler import greedy_picks

    for x in _argmax_cases(rows, vocab):
        best, finite = torch.ops.pagedkv.greedy_argmax(x)
        ref = torch.argmax(x, dim=-1)
        assert torch.equal(best, ref)
        assert torch.equal(finite, torch.isfinite(x.gather(1, ref.unsqueeze(1))).squeeze(1))
        assert greedy_picks(x) == (ref.tolist(), finite.tolist())
        assert greedy_picks(x[:, ::1].t().contiguous().t()) == (ref.tolist(), finite.tolist())  # strided: torch


def test_greedy_argmax_refuses_bad_logits():
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.pagedkv.greedy_argmax(torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"\[n, V\]"):
        torch.ops.pagedkv.greedy_argmax(torch.zeros(5))
