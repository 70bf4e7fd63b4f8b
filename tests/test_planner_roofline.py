"""Roofline bounds: exact formulas on a dense model, the ridge point, prefill and sweeps."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.planner import get_device, load_model, plan
from pagedkv.planner.params import count_params
from pagedkv.planner.roofline import Roofline, causal_pairs, chunk_work, sweep_batches


def _rf(name="llama-3-8b", gpu="h100-sxm", dtype="bfloat16", tp=1):
    m = load_model(name)
    return m, Roofline(m, m.kv_spec(dtype, tp=tp), get_device(gpu), dtype, tp)


def test_decode_memory_bound_is_weights_plus_kv_over_bandwidth():
    m, rf = _rf()
    c = count_params(m)
    weights = (c.total - c.embedding) * 2  # untied: the lookup table is not streamed
    kv = 16 * 131_072 * 4096
    step = rf.decode(16, 4096)
    assert step.bytes_read == weights + kv
    assert step.memory_seconds == pytest.approx((weights + kv) / 3.35e12)
    assert step.limited_by == "memory" and step.tokens_per_s == pytest.approx(16 / step.seconds)


def test_ridge_batch_is_where_compute_overtakes_memory():
    _, rf = _rf("llama-3-8b", "h100-sxm")
    ridge = rf.ridge_batch(128)  # short contexts: weights dominate, batching pays until compute wins
    assert ridge is not None and ridge > 1
    assert rf.decode(ridge, 128).limited_by == "compute"
    assert rf.decode(ridge - 1, 128).limited_by == "memory"


def test_long_context_gqa_decode_never_compute_bound():
    _, rf = _rf("llama-3-70b", "a100-80gb-sxm4", "float16", tp=2)
    assert rf.ridge_batch(4096) is None  # KV reads per sequence cost more than its FLOPs
    big = rf.decode(4096, 4096)
    assert big.tokens_per_s < rf.kv_bound_tokens_per_s(4096)
    assert big.tokens_per_s > 0.9 * rf.kv_bound_tokens_per_s(4096)


def test_prefill_is_compute_bound_and_tp_halves_it():
    _, one = _rf("llama-3-70b", "h100-sxm", tp=1)
    _, two = _rf("llama-3-70b", "h100-sxm", tp=2)
    p1, p2 = one.prefill(4096), two.prefill(4096)
    assert p1.limited_by == "compute"
    assert p2.compute_seconds == pytest.approx(p1.compute_seconds / 2)
    assert p1.flops > 2 * count_params(load_model("llama-3-70b")).active * 4096 * 0.9


def test_tensor_parallel_steps_pay_their_all_reduces_over_the_gpu_link():
    """Two all-reduces per layer of tokens x hidden 16-bit activations; a ring moves
    2 (tp - 1) / tp of each per device, one way over NVLink (half its bidirectional 600 GB/s
    on A100); none at tp 1; a PCIe card (L4) goes over its host link."""
    _, one = _rf("llama-3-70b", "a100-80gb-sxm4", "float16", tp=1)
    _, four = _rf("llama-3-70b", "a100-80gb-sxm4", "float16", tp=4)
    assert one.decode(8, 1024).allreduce_seconds == 0.0
    step = four.decode(8, 1024)
    want = 8 * 80 * 2 * 8192 * 2 * (3 / 4) * 2 / 300e9
    assert step.allreduce_seconds == pytest.approx(want)
    assert step.seconds == pytest.approx(max(step.memory_seconds, step.compute_seconds) + want)
    prefill = four.prefill(2048)
    assert prefill.allreduce_seconds == pytest.approx(want * 2048 / 8)
    _, l4 = _rf("llama-3-8b", "l4", "float16", tp=2)
    assert l4.decode(1, 128).allreduce_seconds == pytest.approx(32 * 2 * 4096 * 1 * 2 / get_device("l4").host_link)


def test_fp8_weights_use_fp8_rate_only_where_present():
    h100, a100 = get_device("h100-sxm"), get_device("a100-80gb-sxm4")
    assert h100.matmul_rate("fp8_e4m3") == h100.flops_fp8 == pytest.approx(2 * h100.matmul_rate("bfloat16"), rel=1e-3)
    assert a100.matmul_rate("fp8_e4m3") == a100.flops_16


def test_sweep_batches():
    assert sweep_batches(32, 10) == [1, 2, 4, 8, 16, 32]
    assert sweep_batches(3, 25) == [1, 2, 3, 4, 8, 16, 25]
    assert max(sweep_batches(1, 10**6)) == 4096


def test_plan_speed_fields_and_transfers():
    r = plan("llama-3-8b", gpu="h100-sxm", seq_len=2048, batch=8)
    assert r.decode.seconds >= max(r.decode.memory_seconds, r.decode.compute_seconds)
    assert [row.batch for row in r.batch_sweep][0] == 1 and any(row.batch == 8 for row in r.batch_sweep)
    assert r.host_link_seconds == pytest.approx(r.paged_bytes_per_request / 63.02e9)
    assert r.nvme_seconds == pytest.approx(r.paged_bytes_per_request / 7.45e9)
    weights = r.decode.bytes_read - 8 * r.bytes_per_request  # dense: a step reads W + batch x KV
    assert r.kv_equals_weights_batch == pytest.approx(weights / r.bytes_per_request)


@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3000)), max_size=12), st.integers(0, 64))
def test_chunk_work_counts_what_its_definition_says(chunks, sampled):
    # one pass with the pair count inlined (the simulator calls it every step) must equal
    # the per-chunk definition: tokens, context read once, causal query-key pairs
    w = chunk_work(chunks, sampled)
    assert (w.tokens, w.sampled) == (sum(n for _, n in chunks), sampled)
    assert w.kv_tokens == sum(s + n for s, n in chunks)
    assert w.attn_pairs == sum(sum(range(s + 1, s + n + 1)) for s, n in chunks)
    assert w.attn_pairs == sum(causal_pairs(s, n) for s, n in chunks)
