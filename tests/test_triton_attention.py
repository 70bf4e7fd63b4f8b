"""The Triton paged-attention kernel (issue 52) against the pure-torch reference, under
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before the kernel module is
imported; on a GPU machine the same cases would run compiled): mixed batches of decodes and
prefill chunks over cached pages, ragged, last-page and exactly-full-page lengths, GQA/MQA/MHA,
a head_dim that is not a power of two, every page dtype and scale granularity, windows with
sinks (and their own queries), softcap, and flash-decoding splits. The slots no sequence
reads, and the scales of quantized ones, hold NaN: a read the masks let through would show.

The interpreter costs about 5 ms per program and page: the shapes are small."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from pagedkv.attention.metadata import AttentionMetadata, SeqAttention  # noqa: E402
from pagedkv.attention.reference import paged_attention_reference  # noqa: E402
from pagedkv.kernels.triton.paged_attention import paged_attention_triton, supports  # noqa: E402
from pagedkv.kv_cache import quant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIXED = [(1, 40), (7, 23), (1, 1), (20, 20), (1, 32), (5, 37)]  # decodes, chunks over cached pages, a whole prompt


def make_batch(specs, heads=6, kv_heads=2, head_dim=32, block_size=16, seed=0, spare=3):
    """Random q and fp32 pages for sequences ``specs`` = [(query_len, context_len)] with
    shuffled block tables; every slot no sequence reads holds NaN."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-ctx // block_size) for _, ctx in specs)
    shape = (need + spare, block_size, kv_heads, head_dim)          # [num_blocks, block_size, kv_heads, head_dim]
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    pool = torch.randperm(need + spare, generator=g)
    seqs, row, used = [], 0, 0
    for query_len, ctx in specs:
        n = -(-ctx // block_size)
        table = pool[used:used + n].clone()
        for i, blk in enumerate(table.tolist()):  # only the context's slots are written
            filled = min(block_size, ctx - i * block_size)
            k[blk, :filled] = torch.randn(filled, kv_heads, head_dim, generator=g)
            v[blk, :filled] = torch.randn(filled, kv_heads, head_dim, generator=g)
        seqs.append(SeqAttention(row, query_len, ctx, table))
        used, row = used + n, row + query_len
    q = torch.randn(row, heads, head_dim, generator=g)              # [T, heads, head_dim]
    return q, k, v, AttentionMetadata(torch.zeros(row, dtype=torch.int64), seqs)


def _finite_pages(x: torch.Tensor) -> torch.Tensor:
    """The reference reads only context slots, but whole pages: its input without the NaN."""
    return torch.nan_to_num(x, nan=0.0) if x.is_floating_point() and x.element_size() > 1 else x


def check(q, k, v, meta, *, k_scale=None, v_scale=None, tol=2e-5, **kw):
    ref = paged_attention_reference(q, _finite_pages(k), _finite_pages(v), meta, q.shape[-1] ** -0.5, k_scale,
                                    v_scale, **{a: b for a, b in kw.items() if a != "num_splits"})
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    out = paged_attention_triton(dev(q), dev(k), dev(v), meta, q.shape[-1] ** -0.5, dev(k_scale), dev(v_scale),
                                 **{a: dev(b) if isinstance(b, torch.Tensor) else b for a, b in kw.items()})
    assert torch.isfinite(out).all() and out.abs().max() > 0.1
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=tol, atol=tol)
    return out


@pytest.mark.parametrize("specs", [MIXED, [(1, 16)], [(16, 16)], [(1, 17)], [(3, 48), (1, 15)]],
                         ids=["mixed", "decode-full-page", "prefill-full-page", "decode-one-over", "ragged"])
def test_mixed_batches_and_page_boundaries(specs):
    check(*make_batch(specs))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 32), (4, 1, 16), (4, 4, 16), (3, 1, 24)],
                         ids=["gqa", "mqa", "mha", "head-dim-24"])
def test_gqa_mqa_mha_and_a_padded_head_dim(heads, kv_heads, head_dim):
    check(*make_batch([(1, 21), (4, 9)], heads, kv_heads, head_dim, seed=3))


def test_a_small_block_size_on_cpu():
    check(*make_batch([(2, 13), (1, 8)], block_size=8, seed=4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_pages(dtype):
    q, k, v, meta = make_batch(MIXED[:3], seed=5)
    k, v = k.to(dtype), v.to(dtype)
    check(q, k, v, meta, tol=1e-4)  # the reference reads the same rounded values: products in fp32 either way


def _quantized(x: torch.Tensor, dtype: str, granularity: str):
    """``x`` quantized as the KV cache stores it, and its scales (NaN in slots never written)."""
    written = torch.isfinite(x[..., 0])                              # [num_blocks, block_size, kv_heads]
    flat = torch.nan_to_num(x, nan=0.0)
    nb, bs, hkv, d = x.shape
    if granularity == "per-token-head":
        s = quant.round_up_to_bfloat16(quant.compute_scales(flat.view(-1, hkv, d), dtype, granularity))
        s = s.view(nb, bs, hkv).to(torch.bfloat16)
        q = quant.quantize(flat, s.float().unsqueeze(-1), dtype)
        s = s.float().masked_fill(~written, float("nan")).to(torch.bfloat16)
    else:
        s = quant.compute_scales(flat.view(-1, hkv, d), dtype, granularity)
        shape = {"per-head": (1, 1, hkv, 1), "per-tensor": (1, 1, 1, 1), "per-channel": (1, 1, hkv, d)}[granularity]
        q = quant.quantize(flat, s.view(shape), dtype)
    return q, s


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["per-token-head", "per-head", "per-tensor", "per-channel"])
def test_quantized_pages_and_every_scale_granularity(dtype, granularity):
    q, k, v, meta = make_batch([(1, 33), (6, 20)], seed=6)
    kq, ks = _quantized(k, dtype, granularity)
    vq, vs = _quantized(v, dtype, "per-token-head" if granularity == "per-channel" else granularity)
    if granularity != "per-token-head":  # then unwritten quantized slots must be read as nothing either
        kq.view(torch.uint8)[~torch.isfinite(k[..., 0])] = 0x7F
    check(q, kq, vq, meta, k_scale=ks, v_scale=vs, tol=1e-4)


def test_fp8_bits_decode_exactly():
    """Every finite e4m3 and e5m2 byte: the kernel's bit decoding equals torch's cast (the
    pages of one token, scale 1, seen through a one-hot value row)."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        vals = codes.float()
        codes = codes[torch.isfinite(vals)]
        n = codes.numel()
        k = torch.zeros(n, 16, 1, 16, dtype=dtype)
        v = torch.zeros(n, 16, 1, 16, dtype=dtype)
        v[:, 0, 0, 0] = codes  # one token per page: attention over it returns its value
        meta = AttentionMetadata(torch.zeros(n, dtype=torch.int64),
                                 [SeqAttention(i, 1, 1, torch.tensor([i])) for i in range(n)])
        q = torch.zeros(n, 1, 16)
        out = paged_attention_triton(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), meta, 1.0)
        assert torch.equal(out[:, 0, 0].cpu(), codes.float()), dtype


@pytest.mark.parametrize("window,sinks,use_sink_q", [(8, 0, False), (8, 4, False), (8, 4, True), (20, 16, True)])
def test_windows_and_sinks(window, sinks, use_sink_q):
    q, k, v, meta = make_batch([(1, 45), (10, 40), (1, 7), (24, 24)], seed=7)
    sink_q = torch.randn_like(q) if use_sink_q else None
    check(q, k, v, meta, window=window, sinks=sinks, sink_q=sink_q)


def test_softcap():
    q, k, v, meta = make_batch(MIXED[:4], seed=8)
    check(q * 30, k, v, meta, softcap=5.0, tol=5e-5)  # scores far past the cap


@pytest.mark.parametrize("splits", [2, 4])
def test_flash_decoding_splits_give_the_one_pass_result(splits):
    q, k, v, meta = make_batch([(1, 70), (1, 5), (3, 50)], seed=9)
    one = check(q, k, v, meta, num_splits=1)
    many = check(q, k, v, meta, num_splits=splits)
    torch.testing.assert_close(many, one, rtol=1e-6, atol=1e-6)
    check(q, k, v, meta, num_splits=splits, window=12, sinks=4, sink_q=torch.randn_like(q))


def test_what_the_kernel_does_not_take_is_refused():
    q, k, v, meta = make_batch([(1, 4)], block_size=16)
    assert supports(q, k, v)
    assert not supports(q, k, v.to(torch.float16))                  # two page dtypes
    assert not supports(q[:, :5], k, v)                              # 5 heads over 2 KV heads
    with pytest.raises(ValueError, match="does not take"):
        paged_attention_triton(q, k[:, :12], v[:, :12], meta, 1.0)   # a block size of 12


def test_q_and_sink_q_with_their_own_strides():
    """The model's q is a view into its fused QKV output (rows strided by the three
    projections) while sink_q is contiguous: each is read with its own strides (the kernel
    read sink_q with q's, which gave NaN and wrong rows in a streaming prefill)."""
    q, k, v, meta = make_batch([(40, 40), (1, 33)], seed=11)
    wide = torch.randn(q.shape[0], q.shape[1] * 3, q.shape[2])
    wide[:, :q.shape[1]] = q
    strided = wide[:, :q.shape[1]]                                   # [T, H, D], row stride 3 * H * D
    assert not strided.is_contiguous()
    sink_q = torch.randn_like(q)
    check(strided, k, v, meta, window=8, sinks=4, sink_q=sink_q)
    check(q, k, v, meta, window=8, sinks=4, sink_q=torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2])[..., ::2])
