"""Property tests of the KV arithmetic the planner prints (through the planner's own path)."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kv.spec import DTYPE_BYTES
from pagedkv.model.hf_config import parse

FLOAT_DTYPES = ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4"]
sizes = st.integers(min_value=1, max_value=64)


def _model(layers=4, heads=8, kv=2, head_dim=64, window=None, **extra):
    cfg = dict(model_type="llama", num_hidden_layers=layers, hidden_size=heads * head_dim,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, vocab_size=100,
               sliding_window=window, **extra)
    return parse(cfg, "t", "test")


def _bpt(dtype="bfloat16", **kw):
    return _model(**kw).kv_spec(dtype, scale_granularity="per-tensor").bytes_per_token


@settings(max_examples=40, deadline=None)
@given(layers=sizes, kv=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([32, 64, 96, 128, 256]))
def test_bytes_per_token_is_linear_in_layers_heads_and_head_dim(layers, kv, head_dim):
    one = _bpt(layers=1, heads=8, kv=1, head_dim=head_dim)
    assert _bpt(layers=layers, heads=8, kv=kv, head_dim=head_dim) == layers * kv * one
    assert one == 2 * head_dim * 2  # K and V, 2 bytes each


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from(FLOAT_DTYPES), layers=sizes)
def test_bytes_scale_with_dtype_size_without_per_token_scales(dtype, layers):
    m = _model(layers=layers)
    got = m.kv_spec(dtype, scale_granularity="per-tensor").bytes_per_token
    assert got == math.ceil(m.kv_spec("float32").bytes_per_token * DTYPE_BYTES[dtype] / 4)


@settings(max_examples=20, deadline=None)
@given(heads=st.sampled_from([4, 8, 16, 32, 64]), layers=sizes)
def test_mqa_is_one_over_heads_of_mha(heads, layers):
    m = _model(layers=layers, heads=heads, kv=heads)
    mha = m.kv_spec("float16").bytes_per_token
    assert m.with_kv_heads(1).kv_spec("float16").bytes_per_token * heads == mha


def test_quantized_scales_are_counted():
    m = _model(layers=2, heads=8, kv=2, head_dim=64)
    elems = 2 * 2 * 64  # per layer and token: 2 KV heads x (K + V) x 64
    per_token_head = m.kv_spec("int8", scale_granularity="per-token-head")
    assert per_token_head.bytes_per_token == 2 * (elems + 2 * 2 * 2)  # one bf16 scale per head, K and V
    assert m.kv_spec("int4", scale_granularity="per-token-head").bytes_per_token == 2 * (elems // 2 + 8)
    per_head = m.kv_spec("fp8_e4m3", scale_granularity="per-head")
    assert per_head.bytes_per_token == 2 * elems and per_head.static_bytes == 2 * 2 * 2 * 4
    assert m.kv_spec("int8", scale_granularity="per-tensor").static_bytes == 2 * 2 * 4
    assert m.kv_spec("bfloat16").static_bytes == 0


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 300), n=st.integers(1, 1000), block=st.sampled_from([1, 8, 16]))
def test_sliding_layers_are_capped(window, n, block):
    m = _model(layers=3, window=window)
    spec = m.kv_spec("float16", block_size=block)
    per_layer = spec.bytes_per_token_layer
    assert spec.bytes_for_tokens(n) == 3 * min(n, window) * per_layer
    cap_blocks = -(-window // block) + 1
    assert spec.paged_bytes_for_tokens(n) <= 3 * cap_blocks * block * per_layer
    assert spec.paged_bytes_for_tokens(n) >= spec.bytes_for_tokens(n)


def test_mixed_sliding_and_full_layers():
    m = parse(dict(model_type="gemma2", num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=10, sliding_window=32), "g", "test")
    spec = m.kv_spec("float16", block_size=16)
    per = spec.bytes_per_token_layer
    assert spec.bytes_for_tokens(1000) == (2 * 32 + 2 * 1000) * per  # 2 sliding + 2 full layers


@settings(max_examples=30, deadline=None)
@given(kv=st.sampled_from([1, 2, 4, 8]), tp=st.sampled_from([1, 2, 4, 8, 16]))
def test_tp_splits_kv_heads_or_replicates(kv, tp):
    m = _model(heads=16, kv=kv)
    per_device = m.kv_spec("float16", tp=tp).num_kv_heads
    assert per_device == (kv // tp if kv >= tp else 1)
    assert per_device * tp >= kv  # never fewer heads than the model has
