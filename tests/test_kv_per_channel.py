"""Per-channel (KIVI-style) KV scales: keys get one static scale per KV head and channel
(calibrated at engine start), values one bfloat16 scale per token and head. Bytes match the
spec, the kernel reads them as the reference does, the engine is batch-invariant with them,
and a key channel outlier costs per-channel scales less than per-token-head ones."""

from __future__ import annotations

import torch
from test_attention_kernel import op  # noqa: F401  (the module-scoped kernel fixture)

from pagedkv import SamplingParams
from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
from pagedkv.attention.reference import paged_attention_reference
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.kv_cache import quant
from pagedkv.kv_cache.storage import KVCacheStorage

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_spec_and_storage_bytes():
    spec = KVCacheSpec(3, 2, 16, "int8", 16, scale_granularity="per-channel")
    assert spec.bytes_per_token_layer == 2 * 2 * 16 + 2 * 2        # K+V int8, one bf16 V scale per head
    assert spec.static_bytes == 3 * 2 * 16 * 4                      # fp32 K scale per head and channel
    st = KVCacheStorage(spec, 5)
    assert st.nbytes == 5 * spec.page_size_bytes + spec.static_bytes
    assert st.k_scale[0].shape == (2, 16) and st.v_scale[0].shape == (5, 16, 2)


def test_channel_outlier_favours_per_channel_keys():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(256, 2, 64, generator=g)
    k[:, :, 5] *= 20.0                                              # a fixed outlier channel
    err = {}
    for gran in ("per-token-head", "per-channel"):
        s = quant.scale_view(quant.compute_scales(k, "int8", gran), gran)
        diff = quant.dequantize(quant.quantize(k, s, "int8"), s) - k
        err[gran] = diff[:, :, [c for c in range(64) if c != 5]].pow(2).mean().sqrt().item()  # other channels
    assert err["per-channel"] < err["per-token-head"] / 5


def test_kernel_reads_per_channel_keys_like_the_reference(op):  # noqa: F811
    g = torch.Generator().manual_seed(1)
    nb, bs, hkv, d, h = 12, 16, 2, 64, 4
    x = {n: torch.randn(nb * bs, hkv, d, generator=g) for n in "kv"}
    x["k"][:, :, 3] *= 15.0
    ks = quant.compute_scales(x["k"], "fp8_e4m3", "per-channel")                  # [Hkv, D]
    vs = quant.compute_scales(x["v"], "fp8_e4m3", "per-token-head")               # [T, Hkv]
    kq = quant.quantize(x["k"], quant.scale_view(ks, "per-channel"), "fp8_e4m3").view(nb, bs, hkv, d)
    vq = quant.quantize(x["v"], quant.scale_view(vs, "per-token-head"), "fp8_e4m3").view(nb, bs, hkv, d)
    vs = vs.view(nb, bs, hkv).bfloat16()
    perm = torch.randperm(nb, generator=g)
    seqs = [SeqAttention(0, 1, 70, perm[:5].clone()), SeqAttention(1, 6, 33, perm[5:8].clone())]
    meta = AttentionMetadata(torch.zeros(7, dtype=torch.int64), seqs)
    q = torch.randn(7, h, d, generator=g)
    ref = paged_attention_reference(q, kq, vq, meta, d ** -0.5, ks, vs)
    out = op(q, kq, vq, *meta.packed, d ** -0.5, -1, ks, vs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_engine_per_channel_is_calibrated_and_batch_invariant(tiny_llm_factory):
    prompts = [{"prompt_token_ids": list(range(300 + 23 * i, 330 + 29 * i))} for i in range(3)]
    make = lambda **kw: tiny_llm_factory(kv_cache_dtype="int8", kv_cache_scale="per-channel", **kw)  # noqa: E731
    solo = [make(num_blocks=32).generate([p], GREEDY)[0].token_ids for p in prompts]
    llm = make(num_blocks=6, max_num_batched_tokens=16)             # tight: preemption and chunking
    st = llm.engine.parts.kv_cache
    assert not torch.equal(st.k_scale[0], torch.ones_like(st.k_scale[0]))  # calibrated at start
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == solo
    assert llm.stats().blocks_used == 0
