"""The fused kernel's read of int8/fp8 pages: every stored byte code dequantizes exactly as
the reference does (``float(q) * scale``, subnormal fp8 codes included), attention over
quantized pages matches the reference for each dtype and scale granularity at ragged and
block-boundary lengths, and the dispatcher sends quantized pages to the kernel."""

from __future__ import annotations

import pytest
import torch
from test_attention_kernel import BOUNDARY, op  # noqa: F401  (the module-scoped kernel fixture)

from pagedkv.attention.dispatch import paged_attention
from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
from pagedkv.attention.reference import paged_attention_reference
from pagedkv.kv_cache import quant

DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]
GRANULARITIES = ["per-token-head", "per-head", "per-tensor", "per-channel"]
D, HKV, H, BS = 64, 2, 4, 16


def finite_codes(dtype: str) -> torch.Tensor:
    """Every byte code of ``dtype`` that is a finite value (fp8 inf/NaN codes excluded)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if dtype == "int8":
        return codes
    vals = codes.view(quant.STORAGE_DTYPES[dtype]).float()
    return codes[torch.isfinite(vals)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_dequantizes_exactly(op, dtype):  # noqa: F811
    """A one-key context returns that key's V row exactly, so the output is the dequantized V."""
    codes = finite_codes(dtype)
    rows = -(-codes.numel() // D)
    flat = torch.zeros(rows * D, dtype=torch.uint8)
    flat[:codes.numel()] = codes
    num_blocks = rows                                  # one block per row of codes, slot 0, KV head 0
    v = torch.zeros(num_blocks, BS, HKV, D, dtype=torch.uint8)
    v[:, 0, 0] = flat.view(rows, D)
    v = v.view(quant.STORAGE_DTYPES[dtype])
    k = torch.zeros_like(v)
    scale = (torch.rand(num_blocks, BS, HKV) * 3 + 0.01).bfloat16()   # per-token-head, as stored
    seqs = [SeqAttention(i, 1, 1, torch.tensor([num_blocks - 1 - i])) for i in range(num_blocks)]
    meta = AttentionMetadata(torch.zeros(num_blocks, dtype=torch.int64), seqs)
    q = torch.randn(num_blocks, H, D)
    out = op(q, k, v, *meta.packed, D ** -0.5, -1, scale, scale.clone())
    table = torch.tensor([num_blocks - 1 - i for i in range(num_blocks)])
    expect = quant.dequantize(v[table, 0, 0], scale[table, 0, 0].float().unsqueeze(-1))   # [rows, D]
    assert torch.equal(out[:, 0], expect)              # query head 0 reads KV head 0


def quantized_batch(dtype: str, gran: str, specs, seed: int = 0):
    """Random q and K/V (with an outlier KV head, an all-zero block and tiny values) quantized
    into shuffled pages; returns (q, k, v, k_scale, v_scale, meta)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-ctx // BS) for _, ctx in specs) + 3
    pages, scales = [], []
    for _ in range(2):
        x = torch.randn(num_blocks * BS, HKV, D, generator=g)
        x[:, 1] *= 25.0                                    # outlier head
        x[:BS] = 0.0                                       # an all-zero block
        x[BS:2 * BS] *= 1e-6                               # tiny values (fp8 subnormal codes)
        s = quant.compute_scales(x, dtype, gran)
        pages.append(quant.quantize(x, quant.scale_view(s, gran), dtype).view(num_blocks, BS, HKV, D))
        scales.append(s.view(num_blocks, BS, HKV) if gran == "per-token-head" else s)
    pool = torch.randperm(num_blocks, generator=g)
    seqs, row, used = [], 0, 0
    for query_len, ctx in specs:
        n = -(-ctx // BS)
        seqs.append(SeqAttention(row, query_len, ctx, pool[used:used + n].clone()))
        used, row = used + n, row + query_len
    q = torch.randn(row, H, D, generator=g)
    meta = AttentionMetadata(torch.zeros(row, dtype=torch.int64), seqs)
    return q, pages[0], pages[1], scales[0], scales[1], meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gran", GRANULARITIES)
def test_matches_reference(op, dtype, gran):  # noqa: F811
    specs = [(1, c) for c in BOUNDARY] + [(5, 40), (17, 17), (3, 300)]
    q, k, v, ks, vs, meta = quantized_batch(dtype, gran, specs)
    as_stored = [(ks, vs)] + ([(ks.bfloat16(), vs.bfloat16())] if gran == "per-token-head" else [])
    for kss, vss in as_stored:  # the cache keeps per-token-head scales in bfloat16 (exact here)
        ref = paged_attention_reference(q, k, v, meta, D ** -0.5, kss, vss)
        out = op(q, k, v, *meta.packed, D ** -0.5, -1, kss, vss)
        assert ref.abs().max() > 0.1
        # float rounding relative to the output's scale (the outlier head's values are ~25x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    if len(as_stored) == 2:
        assert torch.equal(as_stored[1][0].float(), ks)  # compute_scales already rounds to bfloat16


def test_dispatch_sends_quantized_pages_to_the_kernel(op, monkeypatch):  # noqa: F811
    monkeypatch.delenv("PAGEDKV_ATTENTION", raising=False)
    q, k, v, ks, vs, meta = quantized_batch("int8", "per-token-head", [(1, 100), (4, 20)])
    direct = op(q, k, v, *meta.packed, D ** -0.5, -1, ks, vs)
    assert torch.equal(paged_attention(q, k, v, meta, D ** -0.5, ks, vs), direct)


def test_rejects_missing_or_misshapen_scales(op):  # noqa: F811
    q, k, v, ks, vs, meta = quantized_batch("int8", "per-token-head", [(1, 20)])
    with pytest.raises(RuntimeError, match="needs k_scale"):
        op(q, k, v, *meta.packed, D ** -0.5)
    with pytest.raises(RuntimeError, match="scale shape"):
        op(q, k, v, *meta.packed, D ** -0.5, -1, ks[:, :3].contiguous(), vs[:, :3].contiguous())
    with pytest.raises(RuntimeError, match="unquantized"):
        op(q, k.float(), v.float(), *meta.packed, D ** -0.5, -1, ks, vs)
