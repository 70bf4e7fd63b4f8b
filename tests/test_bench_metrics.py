"""Bench metrics and roofline arithmetic: percentiles, request timings, KV waste, bounds."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.bench import report
from pagedkv.bench.metrics import RequestRecord, WasteSamples, distribution, percentile, summarize_requests
from pagedkv.bench.roofline import Machine
from pagedkv.kv.groups import single_group
from pagedkv.kv.manager import KVCacheManager
from pagedkv.planner.roofline import ModelCost, StepWork, bound, causal_pairs, ideal_offline_steps, step_terms


# ---- percentiles -------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentile_matches_numpy_linear(n):
    rng = random.Random(n)
    vals = [rng.uniform(-5, 5) for _ in range(n)]
    for p in (0, 1, 50, 90, 99, 100):
        assert percentile(vals, p) == pytest.approx(float(np.percentile(vals, p)), abs=1e-12)


def test_percentile_small_cases():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([7], 99) == 7
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_distribution_keys_and_empty():
    d = distribution([1.0, 2.0, 3.0])
    assert d == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98), "n": 3}
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}


# ---- request timings ---------------------------------------------------------------
def test_request_record_timings():
    r = RequestRecord(arrival=10.0, num_prompt_tokens=5, token_times=[10.5, 10.7, 11.0, 11.5])
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.5)
    assert r.tpot == pytest.approx(1.0 / 3)
    assert r.itls == pytest.approx([0.2, 0.3, 0.5])
    one = RequestRecord(0.0, 3, [0.25])
    assert one.tpot is None and one.itls == [] and one.ttft == 0.25
    assert RequestRecord(0.0, 3, []).ttft is None


def test_summarize_requests_throughput_and_itl_pooling():
    recs = [RequestRecord(0.0, 10, [1.0, 2.0, 3.0]), RequestRecord(0.0, 20, [2.0, 2.5])]
    m = summarize_requests(recs, duration_s=4.0)
    assert m["output_tokens"] == 5 and m["prompt_tokens"] == 30
    assert m["output_tokens_per_s"] == 1.25
    assert m["total_tokens_per_s"] == 35 / 4
    assert m["requests_per_s"] == 0.5
    assert m["ttft_s"]["mean"] == 1.5
    assert m["itl_s"]["n"] == 3                 # gaps 1, 1, 0.5 pooled over requests
    assert m["tpot_s"]["p50"] == pytest.approx(0.75)   # per-request TPOTs 1.0 and 0.5


# ---- KV waste ----------------------------------------------------------------------
def test_waste_is_slot_weighted():
    w = WasteSamples()
    w.add(100, 50)     # 50% wasted
    w.add(300, 300)    # none wasted
    w.add(0, 0)        # no blocks held: not a waste sample
    s = w.summary()
    assert s["waste"] == pytest.approx(50 / 400)
    assert s["waste_step_mean"] == pytest.approx(0.25)
    assert s["waste_step_max"] == 0.5 and s["samples"] == 3
    with pytest.raises(ValueError):
        w.add(10, 11)
    assert WasteSamples().summary()["waste"] is None


class _Req:
    def __init__(self, rid, n_prompt, max_tokens):
        self.request_id, self.all_token_ids = rid, list(range(1, n_prompt + 1))
        self.num_computed_tokens, self.cache_salt = 0, None
        self.num_prompt_tokens, self.max_tokens = n_prompt, max_tokens


@pytest.mark.parametrize("allocator, allocated", [("paged", 32), ("contiguous", 112)])
def test_slot_usage_paged_vs_contiguous(allocator, allocated):
    """17 tokens written at block size 16: paged holds 2 blocks; contiguous reserves
    ceil((17 + 95) / 16) = 7 blocks at admission."""
    kv = KVCacheManager(64, 16, enable_prefix_caching=False,
                        kv_groups=single_group(1, 16, contiguous=allocator == "contiguous"))
    req = _Req("a", 17, 95)
    assert kv.allocate_slots(req, 17)
    a, f = kv.slot_usage({"a": 17})
    assert (a, f) == (allocated, 17)
    w = WasteSamples()
    w.add(a, f)
    assert w.summary()["waste"] == pytest.approx(1 - 17 / allocated)


# ---- roofline ----------------------------------------------------------------------
COST = ModelCost(weight_bytes=1000, lm_head_bytes=200, layer_matmul_params=100, lm_head_params=50,
                 kv_bytes_per_token=10, attn_flops_per_pair=4)
MACHINE = Machine(read_bandwidth=100.0, fp32_flops=1000.0)


def test_causal_pairs():
    assert causal_pairs(0, 4) == 1 + 2 + 3 + 4
    assert causal_pairs(10, 1) == 11          # a decode at position 10 sees 11 keys
    assert causal_pairs(5, 3) == 6 + 7 + 8


def test_step_terms_arithmetic():
    t = step_terms(StepWork(tokens=2, sampled=1, kv_tokens=30, attn_pairs=5), COST, MACHINE)
    assert t["weight-read"] == pytest.approx(1000 / 100)
    assert t["kv-read"] == pytest.approx(300 / 100)
    assert t["compute"] == pytest.approx((2 * 100 * 2 + 2 * 50 * 1 + 4 * 5) / 1000)
    no_sample = step_terms(StepWork(2, 0, 30, 5), COST, MACHINE)
    assert no_sample["weight-read"] == pytest.approx(800 / 100)   # LM head not read


def test_bound_takes_max_per_step_and_names_the_limit():
    small = StepWork(1, 1, 1, 1)              # memory: 10.1 s vs compute 0.304 s
    big = StepWork(100_000, 1, 1, 1)          # compute: 20 s vs memory 10.1 s
    b = bound([small, big], COST, MACHINE)
    mem = (1000 + 10) / 100
    comp_big = (2 * 100 * 100_000 + 2 * 50 + 4) / 1000
    assert b["bound_s"] == pytest.approx(mem + comp_big)
    assert b["seconds_by_limit"]["weight-read"] == pytest.approx(mem)
    assert b["limited_by"] == "compute"
    long_ctx = bound([StepWork(1, 1, 10_000, 10_000)], COST, MACHINE)
    assert long_ctx["limited_by"] == "kv-read"


def test_ideal_offline_steps():
    steps = ideal_offline_steps([3, 5], [2, 4])
    assert steps[0] == StepWork(8, 2, 8, causal_pairs(0, 3) + causal_pairs(0, 5))
    assert [s.tokens for s in steps[1:]] == [2, 1, 1]          # request 0 needs 1 decode step
    assert steps[1].kv_tokens == (3 + 1) + (5 + 1)
    assert sum(s.sampled for s in steps) == 2 + 4                 # one sample per output token


def test_int8_ceiling_is_the_faster_library(monkeypatch):
    """A slow oneDNN path (AVX2 without VNNI) must not set the int8 ceiling when FBGEMM is
    faster: the rate is the best of both."""
    import time

    import torch

    from pagedkv.bench import roofline

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch has no FBGEMM engine")
    # the slow path alone gives 2 n^3 / slow = 21 MOP/s; FBGEMM at n = 128 read 280 MOP/s on a
    # loaded 2-core machine, where an earlier threshold of 420 MOP/s failed
    n, slow = 128, 0.2
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: time.sleep(slow))
    assert roofline.int8_rate(n, 2) > 2 * 2 * n**3 / slow


def test_ratio_and_goal_bookkeeping():
    res = report.new_result("throughput", {})
    for rep, (a, b) in enumerate([(10.0, 2.0), (9.0, 3.0), (12.0, 2.0)]):
        res["runs"] += [{"system": "x", "repeat": rep, "metrics": {"tps": a}, "roofline": {}},
                        {"system": "y", "repeat": rep, "metrics": {"tps": b}, "roofline": {}}]
    assert report.add_ratio(res, "x/y", "x", "y", "metrics.tps") == 5.0   # per repeat 5, 3, 6
    report.summarize(res)
    assert res["summary"]["x"]["metrics.tps"] == 10.0
    report.add_goal(res, "x/y at least 4", 5.0, 4.0)
    report.add_goal(res, "waste below 5%", 0.07, 0.05, higher_is_better=False)
    report.add_goal(res, "unmeasured", None, 1.0)
    assert [g["met"] for g in res["goals"]] == [True, False, None]
    assert math.isclose(report.flatten({"a": {"b": 1, "c": "s"}, "d": True})["a.b"], 1)


def test_goal_verdicts_carry_a_caution_when_others_used_the_cpus():
    res = report.new_result("latency", {})
    res["runs"] += [{"system": "x", "repeat": 0, "metrics": {}, "roofline": {}, "load": {"others_cpu_share": 0.02}},
                    {"system": "x", "repeat": 1, "metrics": {}, "roofline": {}, "load": {"others_cpu_share": None}}]
    report.add_goal(res, "fraction of the bound", 0.9, 0.8)
    assert "caution" not in report.goals_text(res)  # 2%: a quiet machine
    res["runs"][1]["load"]["others_cpu_share"] = 0.47
    text = report.goals_text(res)
    assert text.splitlines()[0].startswith("fraction of the bound: median 0.9") and "up to 47% of the CPUs" in text


def test_best_run_and_best_ratio():
    res = report.new_result("throughput", {})
    for rep, (a, b) in enumerate([(10.0, 2.0), (30.0, 3.0), (12.0, 4.0)]):
        res["runs"] += [{"system": "x", "repeat": rep, "metrics": {"tps": a, "d": rep}, "roofline": {}},
                        {"system": "y", "repeat": rep, "metrics": {"tps": b, "d": rep}, "roofline": {}}]
    report.summarize(res, "metrics.tps")
    assert res["best"]["x"]["metrics.d"] == 1 and res["best"]["y"]["metrics.d"] == 2
    report.add_ratio(res, "x/y", "x", "y", "metrics.tps")
    assert res["ratios"]["x/y"]["best_of_each"] == 30.0 / 4.0
    report.summarize(res, "metrics.tps", higher=False)
    assert res["best"]["x"]["metrics.d"] == 0
    report.add_goal(res, "g", 2.0, 4.0, best=7.5)
    assert res["goals"][-1]["met"] is False and res["goals"][-1]["met_by_best"] is True


def test_load_meter_counts_own_cpu():
    from pagedkv.bench.load import LoadMeter

    with LoadMeter() as m:
        x = 0
        for i in range(2_000_000):
            x += i
    r = m.result()
    assert 0 < r["own_cpu_share"] <= 1.05
    assert r["others_cpu_share"] is None or 0 <= r["others_cpu_share"] <= 1.05


def test_causal_pairs_with_a_window_is_the_planner_prefill_count():
    assert causal_pairs(0, 10, window=4) == 1 + 2 + 3 + 4 * 7
    assert causal_pairs(6, 3, window=4) == 4 * 3 and causal_pairs(2, 2, window=4) == 3 + 4
    assert causal_pairs(5, 3, window=None) == causal_pairs(5, 3)


def test_engine_cost_agrees_with_the_planner_parameter_count(tiny_llm_factory):
    """bench counts the loaded tensors, the planner counts from config.json: same model."""
    from pagedkv.bench.roofline import model_cost
    from pagedkv.planner.params import count_params, matmul_params

    engine = tiny_llm_factory().engine
    cfg, cost = engine.parts.files.config, model_cost(engine)
    norms = cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)
    assert cost.weight_bytes == 4 * count_params(cfg).total              # fp32 on CPU
    assert cost.layer_matmul_params + cost.lm_head_params == matmul_params(cfg) - norms
    assert cost.kv_bytes_per_token == cfg.kv_spec("float32").bytes_per_token


def _slot_usage_by_slot(tables: list[dict[str, list[int]]], written: dict[str, int], bs: int, null: int):
    """The definition, page by page: a page's filled slots are the most any table holding it wrote."""
    filled: dict[int, int] = {}
    for t in tables:
        for rid, table in t.items():
            for i, b in enumerate(table):
                if b != null:
                    filled[b] = max(filled.get(b, 0), min(bs, max(0, written.get(rid, 0) - i * bs)))
    return len(filled) * bs, sum(filled.values())


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.lists(st.integers(0, 12), max_size=6), st.integers(-2, 60)),
                                   max_size=6), st.booleans())
def test_slot_usage_matches_its_definition(bs, reqs, two_groups):
    """Shared pages (counted once, at their fullest), null pages (never), pages past the
    written tokens (allocated, empty), written counts past the table or negative; the
    pool's ref counts are the tables' entries, as KVCacheManager.check_invariants holds."""
    from types import SimpleNamespace

    from pagedkv.kv.manager import KVCacheManager

    tables = [{f"r{i}": t for i, (t, _) in enumerate(reqs)}]
    if two_groups:
        tables.append({f"r{i}": t[::-1] for i, (t, _) in enumerate(reqs)})
    written = {f"r{i}": n for i, (_, n) in enumerate(reqs)}
    from collections import Counter

    refs = Counter(b for t in tables for table in t.values() for b in table if b != 0)  # the manager's invariant
    pool = SimpleNamespace(null_block=0, ref_cnt=[refs[b] for b in range(13)], num_used=len(refs))
    fake = SimpleNamespace(block_size=bs, pool=pool, groups=[SimpleNamespace(block_tables=t) for t in tables])
    assert KVCacheManager.slot_usage(fake, written) == _slot_usage_by_slot(tables, written, bs, 0)
