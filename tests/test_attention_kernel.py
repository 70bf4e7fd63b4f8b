"""The fused CPU paged-attention kernel against the pure-torch reference: random inputs
(never zeros), shuffled block tables, block-boundary and ragged lengths, GQA/MQA/MHA,
fp16/bf16 pages, mixed prefill + decode batches; and its determinism: a query row's result
is bit-identical alone, inside a big mixed batch, inside a prefill chunk, with 1 or 2
threads and with context partitions split across threads or not."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
from pagedkv.attention.reference import paged_attention_reference
from pagedkv.kernels.cpu.library import KernelBuildError, load_kernel

BOUNDARY = [1, 15, 16, 17, 31, 32, 33, 64]


@pytest.fixture(scope="module")
def op():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    try:
        return load_kernel()
    except KernelBuildError as e:
        pytest.fail(f"the kernel did not build: {e}")


def make_batch(specs, heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32, seed=0,
               spare_blocks=7):
    """Random q and pages for sequences ``specs`` = [(query_len, context_len)], each with a
    block table drawn from a shuffled pool; returns (q, k_cache, v_cache, meta)."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-ctx // block_size) for _, ctx in specs)
    num_blocks = need + spare_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)           # [num_blocks, block_size, kv_heads, head_dim]
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    pool = torch.randperm(num_blocks, generator=g)
    seqs, row, used = [], 0, 0
    for query_len, ctx in specs:
        n = -(-ctx // block_size)
        seqs.append(SeqAttention(row, query_len, ctx, pool[used:used + n].clone()))
        used, row = used + n, row + query_len
    q = torch.randn(row, heads, head_dim, generator=g)             # [T, heads, head_dim]
    return q, k_cache, v_cache, AttentionMetadata(torch.zeros(row, dtype=torch.int64), seqs)


def run(op, q, k, v, meta, split=-1):
    return op(q, k, v, *meta.packed, q.shape[-1] ** -0.5, split)


def check(op, q, k, v, meta, rtol=1e-5, atol=1e-5):
    ref = paged_attention_reference(q, k, v, meta, q.shape[-1] ** -0.5)
    out = run(op, q, k, v, meta)
    assert out.abs().max() > 0.1  # the inputs are not degenerate
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    return out


@pytest.mark.parametrize("ctx", BOUNDARY)
def test_decode_at_block_boundaries(op, ctx):
    check(op, *make_batch([(1, ctx)], seed=ctx))


@pytest.mark.parametrize("ctx", BOUNDARY)
def test_prefill_at_block_boundaries(op, ctx):
    check(op, *make_batch([(ctx, ctx)], seed=ctx))                 # a whole prompt
    check(op, *make_batch([(max(1, ctx // 2), ctx)], seed=ctx))    # a later chunk of it


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4), (12, 2)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_gqa_mqa_mha(op, heads, kv_heads, head_dim):
    check(op, *make_batch([(1, 40), (7, 23), (1, 1), (20, 100)], heads, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_half_precision_pages(op, dtype, head_dim):
    # the reference widens the same stored values, so fp32 tolerances still hold
    check(op, *make_batch([(1, 33), (13, 70), (1, 300), (5, 5)], head_dim=head_dim, dtype=dtype))


@pytest.mark.parametrize("block_size", [1, 8, 32, 48])
def test_other_block_sizes(op, block_size):
    check(op, *make_batch([(1, 97), (9, 50), (1, 300)], block_size=block_size))


def test_mixed_ragged_batch(op):
    g = torch.Generator().manual_seed(1)
    specs = []
    for _ in range(24):
        ctx = int(torch.randint(1, 700, (1,), generator=g))
        query_len = 1 if torch.rand(1, generator=g) < 0.6 else int(torch.randint(1, ctx + 1, (1,), generator=g))
        specs.append((query_len, ctx))
    check(op, *make_batch(specs, seed=1))


def test_long_contexts_across_partitions(op):
    # 256-token partitions: 255..257, 511..513 and a 3,000-token context, split or not
    specs = [(1, 255), (1, 256), (1, 257), (3, 513), (1, 3000), (40, 600)]
    q, k, v, meta = make_batch(specs, seed=2)
    out = check(op, q, k, v, meta)
    for split in (0, 1):
        assert torch.equal(run(op, q, k, v, meta, split), out)


def test_row_alone_equals_row_in_big_batch_and_chunk(op):
    """Each row, computed as a lone decode over its own visible keys, is bit-identical to the
    same row computed inside a 600-token mixed batch (its chunk, other sequences around it)."""
    specs = [(1, 900), (37, 300), (1, 17), (200, 530), (1, 64), (16, 16), (1, 2049)]
    q, k, v, meta = make_batch(specs, seed=3)
    full = run(op, q, k, v, meta)
    for s in meta.seqs:
        for r in sorted({0, 1, s.query_len // 2, s.query_len - 1} & set(range(s.query_len))):
            row = s.query_start + r
            ctx = s.context_len - s.query_len + r + 1                 # the row's visible keys
            alone = AttentionMetadata(torch.zeros(1, dtype=torch.int64),
                                      [SeqAttention(0, 1, ctx, s.block_table[:-(-ctx // 16)])])
            for split in (0, 1):
                assert torch.equal(run(op, q[row:row + 1], k, v, alone, split), full[row:row + 1]), (s, r)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window,softcap", [
    (9, 3, 64, 16, 0, 0.0),     # SmolLM2: four rows x three heads per KV head
    (4, 4, 16, 8, 0, 0.0),      # MHA, the smallest head
    (16, 1, 80, 12, 0, 0.0),    # MQA, sixteen heads per KV head, an odd number of ymm
    (20, 1, 32, 16, 0, 0.0),    # more heads per KV head than prefill tiles batch: row by row
    (6, 2, 128, 6, 0, 0.0),     # a page of a size that is not a multiple of 4 keys
    (8, 2, 256, 16, 40, 0.0),   # a window: pages wholly inside it, and pages it cuts
    (9, 3, 48, 16, 0, 3.0),     # soft-capped scores
])
def test_prefill_tile_rows_equal_rows_alone(op, heads, kv_heads, head_dim, block_size, window, softcap):
    """A prefill chunk's rows that see whole pages are batched across the tile's heads (AVX2
    builds); each row must still be bit-identical to the same row computed alone, as a decode,
    and the chunk must match the reference."""
    q, k, v, meta = make_batch([(45, 170)], heads, kv_heads, head_dim, block_size, seed=13)
    scale = head_dim ** -0.5
    args = (scale, -1, None, None, window, 0, None, softcap)
    full = op(q, k, v, *meta.packed, *args)
    ref = paged_attention_reference(q, k, v, meta, scale, window=window, softcap=softcap)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    s = meta.seqs[0]
    for r in (0, 3, 4, 21, 44):
        ctx = s.context_len - s.query_len + r + 1
        alone = AttentionMetadata(torch.zeros(1, dtype=torch.int64),
                                  [SeqAttention(0, 1, ctx, s.block_table[:-(-ctx // block_size)])])
        assert torch.equal(op(q[r:r + 1], k, v, *alone.packed, *args), full[r:r + 1]), r


@pytest.mark.parametrize("heads,kv_heads,window,sinks", [(9, 3, 0, 0), (8, 2, 37, 4), (16, 4, 0, 0), (4, 1, 0, 0)])
def test_a_lone_short_decode_split_by_kv_head_equals_its_row_in_a_batch(op, heads, kv_heads, window, sinks):
    """One decode of a short context is too little work to split by partition: its KV heads go
    to separate threads (fp32 pages). Each must equal the same row computed among eight
    sequences (not split by head), the reference, and itself on one thread."""
    specs = [(1, 9), (1, 120), (1, 255), (1, 300), (1, 64), (1, 33), (1, 200), (1, 17)]
    q, k, v, meta = make_batch(specs, heads, kv_heads, seed=14)
    scale = q.shape[-1] ** -0.5
    sink_q = torch.randn(q.shape, generator=torch.Generator().manual_seed(15)) if sinks else None
    args = (scale, -1, None, None, window, sinks, sink_q)
    batch = op(q, k, v, *meta.packed, *args)
    ref = paged_attention_reference(q, k, v, meta, scale, window=window, sinks=sinks, sink_q=sink_q)
    torch.testing.assert_close(batch, ref, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    for i, s in enumerate(meta.seqs):
        alone = AttentionMetadata(torch.zeros(1, dtype=torch.int64), [SeqAttention(0, 1, s.context_len, s.block_table)])
        lone_q = None if sink_q is None else sink_q[i:i + 1]
        out = op(q[i:i + 1], k, v, *alone.packed, scale, -1, None, None, window, sinks, lone_q)
        assert torch.equal(out, batch[i:i + 1]), s
        try:
            torch.set_num_threads(1)
            assert torch.equal(op(q[i:i + 1], k, v, *alone.packed, scale, -1, None, None, window, sinks, lone_q), out)
        finally:
            torch.set_num_threads(threads)


def test_thread_count_does_not_change_bits(op):
    q, k, v, meta = make_batch([(1, 700), (30, 400), (1, 5)], seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(op, q, k, v, meta)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(run(op, q, k, v, meta), one)


def test_rejects_bad_metadata(op):
    q, k, v, meta = make_batch([(1, 40)])
    info, tables = meta.packed
    bad = tables.clone()
    bad[1] = k.shape[0]
    with pytest.raises(IndexError, match="out of range"):
        op(q, k, v, info, bad, 0.125)
    short = info.clone()
    short[0, 4] = 2                                                # 2 blocks cannot hold 40 tokens
    with pytest.raises(RuntimeError, match="does not cover"):
        op(q, k, v, short, tables, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.double(), k, v, info, tables, 0.125)
    for col, huge in ((0, 2**63 - 2), (3, 2**63 - 2)):  # offsets whose sum with a length wraps
        wrap = info.clone()
        wrap[0, col] = huge
        with pytest.raises(RuntimeError, match="query rows|does not cover"):
            op(q, k, v, wrap, tables, 0.125)


def run_window(op, q, k, v, meta, window, split=-1):
    return op(q, k, v, *meta.packed, q.shape[-1] ** -0.5, split, None, None, window)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 100, 4096])
def test_sliding_window_matches_the_reference(op, window):
    """Rows see keys position - window + 1 .. position: prefill rows whose windows start mid
    page, across pages and partitions, decodes far past the window, split or not."""
    specs = [(1, 15), (1, 16), (1, 17), (1, 300), (40, 600), (17, 17), (1, 3000), (33, 100)]
    q, k, v, meta = make_batch(specs, seed=5)
    ref = paged_attention_reference(q, k, v, meta, q.shape[-1] ** -0.5, window=window)
    out = run_window(op, q, k, v, meta, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for split in (0, 1):
        assert torch.equal(run_window(op, q, k, v, meta, window, split), out)
    if window >= 3000:  # a window past every context is plain causal attention, bit for bit
        assert torch.equal(out, run(op, q, k, v, meta))


def test_sliding_window_row_alone_equals_row_in_batch(op):
    """A windowed row computed alone over only its window's pages equals the same row in a
    batch over the whole context: the masked keys before the window contribute nothing."""
    window = 37
    q, k, v, meta = make_batch([(1, 500), (50, 260)], seed=6)
    full = run_window(op, q, k, v, meta, window)
    s = meta.seqs[1]
    for r in (0, 20, 49):
        row, pos = s.query_start + r, s.context_len - s.query_len + r
        alone = AttentionMetadata(torch.zeros(1, dtype=torch.int64), [SeqAttention(0, 1, pos + 1, s.block_table)])
        assert torch.equal(run_window(op, q[row:row + 1], k, v, alone, window), full[row:row + 1])
    # the reference masks the same keys
    lone = paged_attention_reference(q[:1], k, v, AttentionMetadata(torch.zeros(1, dtype=torch.int64),
                                     [meta.seqs[0]]), q.shape[-1] ** -0.5, window=window)
    g = meta.seqs[0]
    keys = torch.arange(500 - window, 500)
    kk = k[g.block_table[keys // 16], keys % 16]
    vv = v[g.block_table[keys // 16], keys % 16]
    from pagedkv.attention.reference import attend
    torch.testing.assert_close(lone, attend(q[:1], kk, vv, q.shape[-1] ** -0.5), rtol=1e-5, atol=1e-5)


def test_a_negative_window_is_refused(op):
    q, k, v, meta = make_batch([(1, 20)], seed=7)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        run_window(op, q, k, v, meta, -1)


@pytest.mark.parametrize("window,sinks", [(5, 1), (16, 4), (17, 20), (100, 16), (1, 3)])
def test_sinks_and_window_match_the_reference(op, window, sinks):
    """StreamingLLM's pattern: rows see keys 0..sinks-1 and their window; sink pages are read
    even when the window has moved far past them."""
    specs = [(1, 15), (1, 300), (40, 600), (17, 17), (1, 3000), (33, 100)]
    q, k, v, meta = make_batch(specs, seed=8)
    ref = paged_attention_reference(q, k, v, meta, q.shape[-1] ** -0.5, window=window, sinks=sinks)
    out = op(q, k, v, *meta.packed, q.shape[-1] ** -0.5, -1, None, None, window, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, run_window(op, q, k, v, meta, window))  # the sinks change the result
    assert torch.equal(op(q, k, v, *meta.packed, q.shape[-1] ** -0.5, 1, None, None, window, sinks), out)


@pytest.mark.parametrize("window,sinks", [(5, 1), (17, 20), (100, 16)])
def test_sink_queries_score_the_sinks(op, window, sinks):
    """``sink_q`` (streaming's positions within the cache) scores keys 0..sinks-1, ``q`` the
    window: as the reference; ``sink_q = q`` is bit-identical to no ``sink_q``."""
    specs = [(1, 15), (1, 300), (40, 600), (17, 17), (1, 3000), (33, 100)]
    q, k, v, meta = make_batch(specs, seed=10)
    sink_q = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_reference(q, k, v, meta, scale, window=window, sinks=sinks, sink_q=sink_q)
    out = op(q, k, v, *meta.packed, scale, -1, None, None, window, sinks, sink_q)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain = op(q, k, v, *meta.packed, scale, -1, None, None, window, sinks)
    assert not torch.equal(out, plain)
    assert torch.equal(op(q, k, v, *meta.packed, scale, 1, None, None, window, sinks, sink_q), out)
    assert torch.equal(op(q, k, v, *meta.packed, scale, -1, None, None, window, sinks, q.clone()), plain)
    with pytest.raises(RuntimeError, match="sink_q must be"):
        op(q, k, v, *meta.packed, scale, -1, None, None, window, sinks, sink_q[1:])
    with pytest.raises(RuntimeError, match="sinks is 0"):
        op(q, k, v, *meta.packed, scale, -1, None, None, window, 0, sink_q)


def test_sinks_need_a_window(op):
    q, k, v, meta = make_batch([(1, 20)], seed=9)
    with pytest.raises(RuntimeError, match="sinks must be"):
        op(q, k, v, *meta.packed, 0.1, -1, None, None, 0, 4)


@pytest.mark.parametrize("softcap,window,sinks", [(1.0, 0, 0), (2.5, 17, 0), (5.0, 100, 4), (50.0, 0, 0)])
def test_soft_capping_matches_the_reference(op, softcap, window, sinks):
    """Gemma 2's ``cap * tanh(s / cap)`` on every scaled score, before masking, with and
    without windows and sinks; split or not; a cap far above every score changes little."""
    specs = [(1, 15), (1, 300), (40, 600), (17, 17), (1, 3000), (33, 100)]
    q, k, v, meta = make_batch(specs, seed=12)
    q = q * 3  # scores of several units, so small caps bite
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_reference(q, k, v, meta, scale, window=window, sinks=sinks, softcap=softcap)
    out = op(q, k, v, *meta.packed, scale, -1, None, None, window, sinks, None, softcap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(op(q, k, v, *meta.packed, scale, 1, None, None, window, sinks, None, softcap), out)
    plain = op(q, k, v, *meta.packed, scale, -1, None, None, window, sinks)
    assert not torch.equal(out, plain)
    if softcap < 10:
        assert (out - plain).abs().max() > 0.05  # the cap is not a no-op
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        op(q, k, v, *meta.packed, scale, -1, None, None, window, sinks, None, -1.0)
