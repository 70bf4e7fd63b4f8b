"""The simulator's cost model, workloads, sweep, calibration fit, API and CLI."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from pagedkv.bench.workloads import BenchRequest
from pagedkv.cli import main
from pagedkv.planner.hardware import get_device
from pagedkv.planner.models import load_model
from pagedkv.planner.plan import plan
from pagedkv.planner.roofline import Roofline, StepWork, config_cost
from pagedkv.sim.cost import Efficiency, StepCost, step_kind
from pagedkv.sim.fit import fit
from pagedkv.sim.run import simulate
from pagedkv.sim.sweep import MAX_HALVINGS, sweep
from pagedkv.sim.workloads import PAPER_MEANS, load_trace, synthetic_workload


# ---- the cost model is the planner's roofline ------------------------------------------
@pytest.mark.parametrize("model,gpu,tp,dtype", [("llama-3-70b", "a100-80gb-sxm4", 4, "bfloat16"),
                                                ("llama-3-8b", "h100-sxm", 1, "fp8_e4m3"),
                                                ("qwen2.5-7b", "l40s", 1, "bfloat16"),
                                                ("deepseek-v3", "h200", 8, "fp8_e4m3"),
                                                ("mixtral-8x7b", "h100-sxm", 2, "bfloat16")])
@pytest.mark.parametrize("batch,context", [(1, 512), (32, 4096), (256, 1024)])
def test_cost_model_equals_the_planner_roofline_on_decode(model, gpu, tp, dtype, batch, context):
    m, dev = load_model(model), get_device(gpu)
    spec = m.kv_spec("bfloat16", 16, tp)
    bound = Roofline(m, spec, dev, dtype, tp).decode(batch, context)
    cost = StepCost(config_cost(m, spec, dtype, tp), dev, dtype)
    work = StepWork(batch, batch, batch * context, batch * context)  # a decode step: one query per sequence
    mem, comp = cost.terms(work)
    assert mem == pytest.approx(bound.memory_seconds, rel=1e-6)
    assert comp == pytest.approx(bound.compute_seconds, rel=1e-6)
    assert cost.seconds(work, batch) == pytest.approx(bound.seconds, rel=1e-6)


def test_efficiency_factors_and_overheads():
    m, dev = load_model("llama-3-8b"), get_device("a100-80gb-sxm4")
    cost = config_cost(m, m.kv_spec("bfloat16"), "bfloat16")
    decode, prefill = StepWork(8, 8, 8 * 1000, 8 * 1000), StepWork(2048, 1, 2048, 2048 * 2049 // 2)
    plain = StepCost(cost, dev, "bfloat16")
    eff = StepCost(cost, dev, "bfloat16", Efficiency(memory=0.5, compute=0.25, step_overhead_s=0.001,
                                                     request_overhead_s=0.0001))
    assert eff.seconds(decode, 8) == pytest.approx(2 * plain.seconds(decode, 8) + 0.001 + 0.0008)  # memory-bound
    assert eff.seconds(prefill, 1) == pytest.approx(4 * plain.seconds(prefill, 1) + 0.0011)       # compute-bound
    # a separate attention phase: projections' roofline, then KV reads and attention FLOPs at their own rates
    w, mm, kv, attn = plain.phases(decode)
    phased = StepCost(cost, dev, "bfloat16", Efficiency(memory=0.5, compute=0.5, kv_read=0.25, attention=0.1))
    assert phased.seconds(decode, 8) == pytest.approx(max(w, mm) / 0.5 + kv / 0.25 + attn / 0.1)
    assert (w + kv, mm + attn) == pytest.approx(plain.terms(decode))
    few = StepCost(cost, dev, "bfloat16", Efficiency(few_row_factors=(2.0, 1.5)))  # steps of 1 and 2 rows
    one, two, three = (StepWork(k, k, k * 100, k * 100) for k in (1, 2, 3))
    assert (few.seconds(one, 1), few.seconds(two, 2), few.seconds(three, 3)) == pytest.approx(
        (2 * plain.seconds(one, 1), 1.5 * plain.seconds(two, 2), plain.seconds(three, 3)))
    # few-row KV factors scale only the KV-read phase
    phased_few = StepCost(cost, dev, "bfloat16", Efficiency(memory=0.5, compute=0.5, kv_read=0.25, attention=0.1,
                                                            few_row_factors=(2.0,), few_row_kv_factors=(3.0,)))
    w, mm, kv, attn = plain.phases(one)
    assert phased_few.seconds(one, 1) == pytest.approx(2 * (max(w, mm) / 0.5 + attn / 0.1) + 3 * kv / 0.25)
    # a lone prefill takes prefill[M] (straight in log M between anchors, the end's past them),
    # a decode step few_row[M], a step mixing prefill and decodes neither
    pre = StepCost(cost, dev, "bfloat16",
                   Efficiency(few_row_factors=(2.0,) * 64, prefill_factors=((16, 0.5), (64, 0.9))))
    lone = {m: StepWork(m, 1, m, m * (m + 1) // 2) for m in (8, 16, 32, 64, 500)}
    got = {m: pre.seconds(w, 1) / plain.seconds(w, 1) for m, w in lone.items()}
    assert got == pytest.approx({8: 0.5, 16: 0.5, 32: 0.7, 64: 0.9, 500: 0.9})
    mixed = StepWork(40, 4, 400, 1000)
    assert pre.seconds(mixed, 4) == pytest.approx(plain.seconds(mixed, 4))
    # the kind the runner tells (step_kind) beats the shape: one request verifying 4 drafts is a
    # decode of 5 rows, not a 5-token prefill
    assert step_kind([5], [4]) == "decode" and step_kind([5], [0]) == "prefill" and step_kind([5, 1], [0, 0]) == "mixed"
    verify = StepWork(5, 1, 205, 1015)
    assert pre.seconds(verify, 1, "decode") == pytest.approx(2 * plain.seconds(verify, 1))
    assert pre.seconds(verify, 1) == pytest.approx(0.5 * plain.seconds(verify, 1))
    # anchors far apart interpolate in floats (no integer overflow); on an anchor, its factor exactly
    wide = Efficiency(prefill_factors=((16, 0.5), (1 << 40, 0.9)))
    assert 0.5 < wide.correction(1 << 20, 1)[0] < 0.9 and wide.correction(1 << 40, 1) == (0.9, 0.9)
    assert pre.seconds(two, 2) == pytest.approx(2 * plain.seconds(two, 2))
    for bad in (dict(memory=0), dict(compute=2.0), dict(step_overhead_s=-1), dict(kv_read=0.5),
                dict(few_row_factors=(1.0, 0.0)), dict(few_row_kv_factors=(-1.0,)),
                dict(kv_read=0.5, attention=0.0), dict(prefill_factors=((64, 1.0), (16, 1.0))),
                dict(prefill_factors=((16, 0.0),)), dict(prefill_factors=((True, 1.0),)),
                dict(prefill_factors=((16.5, 1.0),)), dict(prefill_factors=(1.0, 2.0)),
                dict(prefill_factors=((16, 1.0), (10 ** 310, 2.0)))):
        with pytest.raises(ValueError):
            Efficiency(**bad)


def test_fit_recovers_known_factors():
    rng = np.random.default_rng(3)
    n = rng.integers(1, 64, 60)
    w, mm = rng.permutation(np.geomspace(1e-4, 1e-2, 60)), np.geomspace(1e-5, 0.1, 60)
    kv, at = rng.uniform(0, 5e-3, 60), rng.permutation(np.geomspace(1e-6, 0.05, 60))
    t = np.maximum(w / 0.6, mm / 0.3) + kv / 0.4 + at / 0.2 + 0.003 + 2e-4 * n
    f = fit(w, mm, kv, at, n, t)
    assert (f.memory, f.compute) == (pytest.approx(0.6, rel=0.03), pytest.approx(0.3, rel=0.03))
    assert (f.kv_read, f.attention) == (pytest.approx(0.4, rel=0.03), pytest.approx(0.2, rel=0.03))
    assert (f.step_overhead_s, f.request_overhead_s) == (pytest.approx(0.003, rel=0.05), pytest.approx(2e-4, rel=0.05))
    assert f.median_abs_rel_error < 0.01
    with pytest.raises(ValueError):
        fit(*([[1e-3] * 4] * 6))


def test_few_row_factors_split_the_kv_phase_where_contexts_differ():
    """1-row steps at two KV sizes recover separate factors for the rest and the KV phase;
    2-row steps at one size get one factor for both; 3 rows is interpolated, 4 and up is 1."""
    from pagedkv.sim.calibrate import few_row_factors

    class Parts:  # phases (rest, kv, -, -) are the modelled parts as they are
        def parts(self, ph, n):
            return ph[0], ph[1]

    samples = [((0.005, kv), 1, 1, 1.2 * 0.005 + 2.5 * kv) for kv in (0.0002, 0.0002, 0.0015, 0.0016)]
    samples += [((0.006, 0.0004), 2, 2, 0.9 * 0.0064), ((0.006, 0.0004), 2, 2, 0.9 * 0.0064)]
    samples += [((0.006, 0.0004), 4, 4, 0.0064)]
    few, few_kv = few_row_factors(Parts(), *zip(*samples), rows=8)
    assert few[:2] == pytest.approx((1.2, 0.9)) and few_kv[:2] == pytest.approx((2.5, 0.9))
    assert (few[2], few_kv[2]) == (pytest.approx(0.95), pytest.approx(0.95)) and len(few) == len(few_kv) == 4
    # past 8 rows an M needs 3 steps: a lone 12-row step decides nothing, three 16-row ones
    # do, and the factors return to 1 in a straight line at 32
    batch = samples + [((0.01, 0.001), 12, 12, 0.05)] + [((0.01, 0.001), 16, 16, 0.8 * 0.011)] * 3
    few, few_kv = few_row_factors(Parts(), *zip(*batch), rows=8)
    assert len(few) == len(few_kv) == 32 and few[15] == pytest.approx(0.8) and few_kv[15] == pytest.approx(0.8)
    assert few[11] == pytest.approx(1.0 + (0.8 - 1.0) * 8 / 12)  # between 4 rows (1.0) and 16 (0.8)
    assert few[23] == pytest.approx(0.9) and few[31] == pytest.approx(1.0)
    # a prefill chunk of M tokens (fewer requests than rows) is not a decode of M rows
    with_prefill = samples + [((0.006, 0.0004), 1, 2, 10 * 0.0064), ((0.006, 0.0004), 1, 2, 10 * 0.0064)]
    assert few_row_factors(Parts(), *zip(*with_prefill), rows=8) == few_row_factors(Parts(), *zip(*samples), rows=8)
    # a split that only noise decides (the rest's factor ~0) falls back to one factor; bad times are left out
    noisy = [((1.0, kv), 1, 1, t) for kv, t in ((0.1, 1.0), (0.2, 2.0), (0.1, 1.0), (0.2, 2.0))]
    few, few_kv = few_row_factors(Parts(), *zip(*(noisy + [((1.0, 0.1), 1, 1, 0.0), ((1.0, 0.1), 1, 1, math.nan)])))
    assert few == few_kv == (pytest.approx(statistics.median([1 / 1.1, 2 / 1.2] * 2)),)


def test_prefill_factors_come_from_lone_prefills():
    """One anchor per token count of one-request prefills (the median of measured / modelled),
    ascending; decodes, several requests' prefills and bad times are left out."""
    from pagedkv.sim.calibrate import prefill_factors

    class Parts:
        def parts(self, ph, n):
            return ph[0], ph[1]

    samples = [((0.09, 0.01), 1, 256, 0.08), ((0.09, 0.01), 1, 256, 0.12), ((0.09, 0.01), 1, 256, 0.11),
               ((0.018, 0.002), 1, 32, 0.03), ((0.01, 0.0), 1, 1, 0.5), ((0.1, 0.0), 4, 256, 0.5),
               ((0.01, 0.0), 1, 64, math.inf), ((0.01, 0.0), 1, 64, 0.0)]
    got = prefill_factors(Parts(), *zip(*samples))
    assert [m for m, _ in got] == [32, 256] and [f for _, f in got] == pytest.approx([1.5, 1.1])
    assert prefill_factors(Parts(), *zip(*samples[4:])) == ()


# ---- workloads ------------------------------------------------------------------------
def test_paper_like_lengths_have_the_papers_means():
    for name, (mi, mo) in PAPER_MEANS.items():
        w = synthetic_workload(name, 4000, max_model_len=2048, seed=1)
        assert np.mean([r.num_prompt_tokens for r in w]) == pytest.approx(mi, rel=0.08)
        assert np.mean([r.output_len for r in w]) == pytest.approx(mo, rel=0.08)
        assert all(r.num_prompt_tokens + r.output_len <= 2048 for r in w)
    w = synthetic_workload("random", 50, input_len=100, output_len=20, range_ratio=0.5)
    assert {50 <= r.num_prompt_tokens <= 150 and 10 <= r.output_len <= 30 for r in w} == {True}


def test_trace_loading_and_its_errors(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text('{"arrival": 0.5, "prompt_len": 10, "output_len": 3}\n\n{"arrival": 1, "prompt_len": 4, '
                    '"output_len": 1}\n')
    reqs = load_trace(good)
    assert [(r.arrival_s, r.num_prompt_tokens, r.output_len) for r in reqs] == [(0.0, 10, 3), (0.5, 4, 1)]
    assert all(type(r.arrival_s) is float for r in reqs)  # an integer arrival (1) too: JSON output keeps 1.0
    epoch = tmp_path / "epoch.jsonl"  # absolute timestamps count from the first arrival
    epoch.write_text('{"arrival": 1718000000, "prompt_len": 2, "output_len": 1}\n'
                     '{"arrival": 1718000002.5, "prompt_len": 2, "output_len": 1}\n')
    assert [r.arrival_s for r in load_trace(epoch)] == [0.0, 2.5]
    whole = tmp_path / "whole.jsonl"  # counts written as floats (10.0) are whole numbers still
    whole.write_text('{"arrival": 0, "prompt_len": 10.0, "output_len": 3.0}\n')
    assert [(r.num_prompt_tokens, r.output_len) for r in load_trace(whole)] == [(10, 3)]
    huge = tmp_path / "huge.jsonl"  # refused before a trillion token ids are made
    huge.write_text('{"arrival": 0, "prompt_len": 1000000000000, "output_len": 3}\n')
    with pytest.raises(ValueError, match="line 1: .* exceed max_model_len 2048"):
        load_trace(huge, max_model_len=2048)
    cases = {"": "no requests", '{"arrival": 0}\n': "line 1", '{"arrival": -1, "prompt_len": 1, "output_len": 1}':
             "line 1", 'not json': "line 1",
             '{"arrival": 0, "prompt_len": 10.7, "output_len": 1}': "line 1: prompt_len and output_len must be integ",
             '{"arrival": 0, "prompt_len": "10", "output_len": 1}': "line 1: .*integers",
             '{"arrival": 0, "prompt_len": true, "output_len": 1}': "line 1: .*integers",
             '{"arrival": 0, "prompt_len": Infinity, "output_len": 1}': "line 1: .*integers",
             '{"arrival": true, "prompt_len": 1, "output_len": 1}': "line 1: .*arrival a number",
             '{"arrival": 1' + '0' * 400 + ', "prompt_len": 1, "output_len": 1}': "line 1: .*finite time",
             '{"arrival": 0, "prompt_len": 1, "output_len": 1}\n{"arrival": 1e308, "prompt_len": 1, "output_len": 1}':
             "line 2: arrives 1e\\+308 s after the first request"}
    for text, msg in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError, match=msg):
            load_trace(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


# ---- simulate() -----------------------------------------------------------------------
def test_simulate_a_70b_model_on_a100s():
    r = simulate("llama-3-70b", "a100-80gb-sxm4", tp=4, workload="random", num_prompts=64, request_rate=math.inf,
                 input_len=512, output_len=64)
    m, s = r.metrics, r.settings
    assert m["num_requests"] == 64 and m["output_tokens"] == 64 * 64 and m["preemptions"] == 0
    # every decode step streams at least one device's weights: the roofline bounds TPOT from below
    weights = s["workload"] and 70.55e9 * 2 / 4
    assert m["tpot_s"]["p50"] >= weights / s["bandwidth_bytes_per_s"] * 0.99
    assert len(r.timeline["t_s"]) == m["steps"] == len(r.timeline["waiting"])
    assert r.timeline["waiting"][0] > 0 and r.timeline["waiting"][-1] == 0  # a burst queues, then drains


def test_the_first_step_after_an_idle_wait_pays_the_wake_up():
    """Efficiency.idle_wake_s lands on the first step after the engine sat idle (the driver
    waited >= IDLE_WAKE_AFTER_S for an arrival), not on a request arriving at the start or
    while others run."""
    from pagedkv.bench.workloads import BenchRequest

    def reqs(gap):
        return [BenchRequest((5,) * 64, 4, 4, arrival_s=a) for a in (0.0, 0.001, gap)]

    def ttfts(wake, gap):
        eff = Efficiency(step_overhead_s=0.002, idle_wake_s=wake)
        r = simulate("llama-3-8b", "a100-80gb-sxm4", workload=reqs(gap), efficiency=eff)
        return [x.ttft for x in r.run.records]  # in completion order: the arrivals' here

    base, woken = ttfts(0.0, 5.0), ttfts(0.5, 5.0)
    assert woken[:2] == pytest.approx(base[:2]) and woken[2] == pytest.approx(base[2] + 0.5)
    assert ttfts(0.5, 0.01) == pytest.approx(ttfts(0.0, 0.01))  # no idle wait: no wake-up
    with pytest.raises(ValueError):
        Efficiency(idle_wake_s=-0.1)


def test_vllms_tensor_parallel_size_is_tp_and_inf_is_json_text(capsys):
    """simulate(tensor_parallel_size=2) runs at tp 2 as --tensor-parallel-size does, and the
    --json output holds no bare Infinity (strict parsers refuse it): an inf rate is "inf"."""
    kw = dict(workload="random", num_prompts=2, input_len=16, output_len=2)
    assert simulate("llama-3-70b", "a100-80gb-sxm4", tensor_parallel_size=2, **kw).settings["tp"] == 2
    assert main(["simulate", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--workload", "random", "--num-prompts",
                 "2", "--request-rate", "inf", "--json"]) == 0
    d = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert d["settings"]["request_rate"] == "inf"


def test_gemma2s_hybrid_pages_double_the_pool_as_in_the_engine():
    """Gemma 2's window and full layers share pages (one group's layers per page), so the
    same memory holds twice the pages; the contiguous allocator (one group) keeps whole-layer
    pages, and the simulator sizes each pool as the engine would."""
    kw = dict(workload="random", num_prompts=4, request_rate=math.inf, input_len=64, output_len=4)
    paged = simulate("gemma-2-9b", "a100-80gb-sxm4", **kw).settings["num_blocks"]
    contiguous = simulate("gemma-2-9b", "a100-80gb-sxm4", kv_allocator="contiguous", **kw).settings
    whole, budget = contiguous["num_blocks"], contiguous["cache_budget_bytes"]
    assert abs(paged - 2 * whole) <= 1
    draft = simulate("gemma-2-9b", "a100-80gb-sxm4", speculative_config={"model": "gemma-2-9b",
                     "num_speculative_tokens": 2}, spec_acceptance_rate=0.5, **kw).settings["num_blocks"]
    # a draft: one group, whole-layer pages with both models' KV, after the draft's bf16 weights
    assert abs(whole * (budget - 2 * 9_241_705_984) / budget - 2 * draft) <= 2


def test_a_small_cache_preempts_and_rejects_what_never_fits():
    reqs = [BenchRequest(tuple(range(1, 200)), 300, 300) for _ in range(16)]
    r = simulate("llama-3-8b", "l4", workload=reqs, request_rate=math.inf, kv_cache_memory="256MiB",
                 enable_prefix_caching=False)
    assert r.metrics["preemptions"] > 0 and r.metrics["peak_kv_blocks"] <= r.settings["num_blocks"]
    with pytest.raises(ValueError, match="the whole KV cache"):
        simulate("llama-3-8b", "l4", workload=[BenchRequest(tuple(range(1, 3000)), 2000, 2000)],
                 kv_cache_memory="64MiB")


@pytest.mark.parametrize("kw,msg", [(dict(model="no-such-model"), "unknown model"),
                                    (dict(gpu="no-such-gpu"), "unknown GPU"),
                                    (dict(request_rate=-1.0), "rate must be positive"),
                                    (dict(workload="no-such-workload"), "unknown workload"),
                                    (dict(model="llama-3-70b", gpu="a100-40gb"), "no room for a KV cache"),
                                    (dict(tp=3), "tp"),
                                    (dict(model="qwen2.5-7b", tp=8), "does not split 4 KV heads"),
                                    (dict(kv_cache_memory="1MiB"), "holds no block"),
                                    (dict(preemption_mode="swap"), "set kv_offload_memory"),
                                    (dict(workload="arena-hard", num_prompts=501), "has 500 prompts"),
                                    (dict(workload="random", num_prompts=-1), "num_prompts"),
                                    (dict(kv_cache_memory="500GiB"), "exceed"),
                                    (dict(workload=[BenchRequest((1, 2), 2, 2, float("nan"))]), "arrival_s"),
                                    (dict(workload=[BenchRequest((1, 2), 0, 2)]), "output_len"),
                                    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
                                     "given draft acceptance rate"),
                                    (dict(speculative_config={"model": "no-such-draft", "num_speculative_tokens": 2},
                                          spec_acceptance_rate=0.5), "unknown model 'no-such-draft'"),
                                    (dict(kv_offload_memory="1GiB", kv_offload_dir="/tmp/x",
                                          kv_offload_disk_size="1KiB"), "holds no block record"),
                                    (dict(request_rate="5"), "must be a number"),
                                    (dict(block_size=10**11), "holds no block of 100000000000 tokens"),
                                    (dict(request_rate=1e-15), "raise the request rate"),
                                    (dict(foo=1), "not an engine setting"),
                                    (dict(random_input_len=5), "--random-input-len input_len"),
                                    (dict(trace="t.jsonl"), "a trace replaces workload"),
                                    (dict(workload=[(1, 2, 3)]), "BenchRequest objects"),
                                    (dict(workload="random", output_len=2.5), "must be integers"),
                                    (dict(workload=[BenchRequest((1, 2), 2, 2, 2e9)]), "arrival_s"),
                                    (dict(spec_acceptance_rate=0.5), "needs speculative decoding"),
                                    (dict(tensor_parallel_size=2, tp=4), "give one integer"),
                                    (dict(model="llama-3-70b", gpu="a100-80gb-sxm4", tp=4,
                                          speculative_config={"model": "llama-3.1-405b", "num_speculative_tokens": 2},
                                          spec_acceptance_rate=0.5), "with the draft model's")])
def test_bad_input_is_a_clear_error(kw, msg):
    args = dict(model="llama-3-8b", gpu="a100-80gb-sxm4", workload="random", num_prompts=2) | kw
    with pytest.raises(ValueError, match=msg):
        simulate(**args)


def test_sweep_finds_the_edge_of_the_target():
    reqs = synthetic_workload("random", 200, input_len=256, output_len=128, range_ratio=0.5)

    def run(rq):
        return simulate("llama-3-8b", "l4", workload=rq).metrics  # (the list's own arrivals)

    best, points = sweep(run, reqs, "ttft_p90", 0.5)
    assert best is not None
    met = [p.rate for p in points if p.meets]
    missed = [p.rate for p in points if not p.meets]
    assert max(met) == best and min(missed) > best and min(missed) / best < 1.1  # bisected close
    with pytest.raises(ValueError, match="unknown latency target"):
        sweep(run, reqs, "ttft_p42", 0.5)


def test_sweep_halves_below_its_start_rate_when_the_start_misses():
    """A target met only under 0.5 req/s (a long workload, a tight latency) still gets a rate.
    The stand-in run's latency is its requests' arrival rate: the edge sits at 0.1 req/s."""
    reqs = synthetic_workload("random", 400, input_len=16, output_len=4)

    def run(rq):
        return {"e2e_s": {"p99": len(rq) / rq[-1].arrival_s}}

    best, points = sweep(run, reqs, "e2e_p99", 0.1)
    assert points[0].rate == 0.5 and not points[0].meets
    assert best is not None and 0.08 < best < 0.12
    assert min(p.rate for p in points if not p.meets) / best < 1.1  # bisected close
    never, points = sweep(lambda rq: {"e2e_s": {"p99": 1.0}}, reqs, "e2e_p99", 0.5)
    assert never is None and len(points) == 1 + MAX_HALVINGS and min(p.rate for p in points) == 0.5 / 2**MAX_HALVINGS


# ---- the command line -----------------------------------------------------------------
def test_plot_takes_every_format_matplotlib_writes(tmp_path, capsys):
    argv = ["simulate", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--workload", "random", "--num-prompts", "4"]
    for name in ("kv.webp", "kv.SVG"):
        assert main([*argv, "--plot", str(tmp_path / name)]) == 0
        assert (tmp_path / name).stat().st_size > 0
    assert main([*argv, "--output", str(tmp_path / "gone.json"), "--plot", str(tmp_path / "kv.txt")]) == 2
    assert not (tmp_path / "gone.json").exists()  # the write probe left nothing behind


def test_cli_json_output_and_plot(tmp_path, capsys):
    plot, out = tmp_path / "kv.png", tmp_path / "r.json"
    assert main(["simulate", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--workload", "random",
                 "--num-prompts", "20", "--request-rate", "5", "--max-num-seqs", "8", "--block-size", "32",
                 "--json", "--plot", str(plot), "--output", str(out)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["settings"]["block_size"] == 32 and d["settings"]["max_num_seqs"] == 8
    assert d["metrics"]["max_running"] <= 8 and d["metrics"]["num_requests"] == 20
    assert "timeline" not in d and "timeline" in json.loads(out.read_text())
    assert plot.stat().st_size > 10_000


def test_cli_text_and_sweep(capsys):
    assert main(["simulate", "--model", "llama-3-8b", "--gpu", "a100-80gb-sxm4", "--weight-dtype", "fp8",
                 "--workload", "random", "--num-prompts", "10"]) == 0
    text = capsys.readouterr().out
    assert "fp8_e4m3 weights" in text and "TTFT p50/p90/p99" in text
    assert main(["simulate", "--model", "llama-3-8b", "--gpu", "a100-80gb-sxm4", "--workload", "random",
                 "--num-prompts", "50", "--sweep", "--target", "tpot_p50=0.02"]) == 0
    assert "highest rate" in capsys.readouterr().out
    assert main(["simulate", "--model", "llama-3-8b", "--gpu", "a100-80gb-sxm4", "--workload", "random",
                 "--num-prompts", "5", "--sweep", "--target", "e2e_p90=1000"]) == 0
    assert "met at every rate tried" in capsys.readouterr().out  # not a made-up edge


RANDOM = ["--workload", "random"]


@pytest.mark.parametrize("argv,msg", [
    ([*RANDOM, "--gpu", "nope"], "unknown GPU"), ([*RANDOM, "--request-rate", "0"], "rate"),
    ([*RANDOM, "--num-prompts", "0"], "--num-prompts"),
    ([*RANDOM, "--sweep", "--target", "ttft_p50"], "METRIC=SECONDS"),
    ([*RANDOM, "--sweep", "--plot", "x.png"], "not with --sweep: --plot"),
    (["--trace", "t.jsonl", "--request-rate", "2"], "not both"),
    (["--trace", "/nonexistent.jsonl"], "cannot read trace"),
    ([*RANDOM, "--trace", "t.jsonl"], "--trace replaces --workload"),
    (["--num-prompts", "5", "--trace", "t.jsonl"], "--trace replaces"),
    ([*RANDOM, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'], "--spec-acceptance-rate"),
    ([*RANDOM, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--spec-acceptance-rate",
      "1.5"], "in [0, 1]"),
    ([*RANDOM, "--spec-acceptance-rate", "0.5"], "needs speculative decoding"),
    ([*RANDOM, "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    ([*RANDOM, "--plot", "kv"], "name an image file"), ([*RANDOM, "--output", ""], "not a file name"),
    ([*RANDOM, "--output", "/proc/nope.json"], "cannot be written"),
    (["--model", "smollm2-135m-instruct", "--gpu", "h200", *RANDOM, "--disagg", "64P64D"],
     "blocks simulated in memory"),
    ([*RANDOM, "--output", "/"], "not a file name"),
    ([*RANDOM, "--request-rate", "1e-15"], "raise the request rate"),
    ([*RANDOM, "--disagg", "999P1D"], "at most 256 instances"),
    ([*RANDOM, "--model", "SmolLM2.Q4_1.gguf"], "is a GGUF file"),
])
def test_cli_bad_input_is_one_line(argv, msg, capsys):
    assert main(["simulate", "--model", "llama-3-8b", "--gpu", "a100-80gb-sxm4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and msg in err and "\n" not in err


def test_cli_takes_vllms_tensor_parallel_size(capsys):
    args = ["simulate", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--workload", "random", "--num-prompts", "4",
            "--json"]
    assert main(args + ["--tensor-parallel-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["tp"] == 2
    assert main(args + ["--tensor-parallel-size", "2", "--tp", "4"]) == 2
    assert "disagree" in capsys.readouterr().err


def test_cpu_tier_copies_priced_as_the_planner_prices_them(monkeypatch):
    """On the CPU both price a page copy at the rate measured for the page's piece size,
    and a disk load adds that copy after the NVMe read."""
    from pagedkv.planner import cpu

    monkeypatch.setattr(cpu, "page_copy_bandwidth", lambda piece, *a, **k: 1e9 + piece)  # deterministic
    kw = dict(kv_cache_memory="64MiB", kv_offload_memory="256MiB", kv_offload_disk_size="1GiB")
    planned = plan("smollm2-135m-instruct", "cpu", **kw)
    s = simulate("smollm2-135m-instruct", "cpu", workload="random", num_prompts=2, input_len=32, output_len=2,
                 kv_offload_dir="/unused", **kw).settings
    page = planned.offload_cpu_block_load_seconds * s["host_link_bytes_per_s"]
    assert s["host_link_bytes_per_s"] == 1e9 + page // (30 * 2)  # a K or V piece per layer
    assert s["disk_block_load_s"] == pytest.approx(planned.offload_disk_block_load_seconds)
    assert s["disk_block_load_s"] > planned.offload_cpu_block_load_seconds  # the disk is the slower tier


def test_calibration_warnings_name_a_suspect_fit():
    from pagedkv.sim.cli import calibration_warnings

    good = {"efficiency": {"memory": 0.7, "compute": 0.8, "kv_read": 0.4, "attention": 0.5},
            "fit": {"median_abs_rel_error": 0.1}}
    assert calibration_warnings(good) == []
    bad = {"efficiency": good["efficiency"] | {"compute": 1.5}, "fit": {"median_abs_rel_error": 0.2}}
    w = calibration_warnings(bad)
    assert len(w) == 2 and "compute at the 1.5 cap" in w[0] and "20%" in w[1]


# ---- calibration on this CPU ----------------------------------------------------------
def test_calibration_is_fitted_cached_and_used(tiny_model_dir, tmp_path, monkeypatch):
    from pagedkv.config.engine import EngineConfig
    from pagedkv.sim import calibrate as cal

    monkeypatch.setattr(cal, "cache_path", lambda: tmp_path / "sim_calibration.json")
    config = EngineConfig(model=str(tiny_model_dir), num_blocks=64, block_size=16)
    r = cal.calibrate(config, quick=True)
    assert r["steps"] >= 10 and 0 < r["efficiency"]["memory"] <= 1.5
    assert r["fit"]["samples"] == r["steps"] and r["reference_s"] > 0
    # the quick profile decodes 1, 8 and 16 requests, three 16-row steps: measured to 16, back to 1 at 32
    assert len(r["efficiency"]["few_row_factors"]) == 32
    assert [m for m, _ in r["efficiency"]["prefill_factors"]] == [16, 128]  # the quick profile's lone prefills
    assert r["efficiency"]["idle_wake_s"] >= 0
    c = cal.cached(config, str(tiny_model_dir))
    eff, cost = c.efficiency, c.cost
    assert (c.bandwidth, c.fp32_flops) == (r["ceilings"]["bandwidth"], r["ceilings"]["fp32_flops"])
    assert c.reference_s == r["reference_s"]
    assert eff.source.startswith("calibrated on this CPU")
    assert cost.kv_bytes_per_token == r["cost"]["kv_bytes_per_token"]
    assert cal.cached(EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="int8"), str(tiny_model_dir)) is None
    s = simulate(str(tiny_model_dir), "cpu", workload="random", num_prompts=4, input_len=32, output_len=4,
                 num_blocks=64, max_model_len=256)
    assert s.settings["efficiency"] == eff.to_dict() and s.metrics["output_tokens"] == 16
    assert s.settings["bandwidth_bytes_per_s"] == c.bandwidth  # priced on the ceilings it was fitted on
    # every decode step pays the fitted overheads on top of the roofline
    assert s.metrics["tpot_s"]["p50"] >= eff.step_overhead_s + eff.request_overhead_s


@pytest.mark.parametrize("damage", [
    lambda d, k: [1, 2], lambda d, k: d | {k: [1]}, lambda d, k: d | {k: d[k] | {"efficiency": None}},
    lambda d, k: d | {k: d[k] | {"ceilings": {"bandwidth": 0, "fp32_flops": 1e11}}},
    lambda d, k: d | {k: d[k] | {"cost": {}}}, lambda d, k: d | {k: d[k] | {"reference_s": "fast"}}])
def test_a_damaged_calibration_entry_is_ignored(tmp_path, monkeypatch, damage):
    """A cache that is JSON but not a calibration's shape (or has impossible ceilings) is
    treated as no calibration, not a traceback or a silently zero-time simulation; fields
    a later version adds to the efficiency are ignored."""
    from pagedkv.config.engine import EngineConfig
    from pagedkv.sim import calibrate as cal

    path = tmp_path / "sim_calibration.json"
    monkeypatch.setattr(cal, "cache_path", lambda: path)
    config = EngineConfig(model="m")
    key = cal.calibration_key(config, "m")
    cost = config_cost(load_model("llama-3-8b"), load_model("llama-3-8b").kv_spec("bfloat16"), "bfloat16")
    good = {key: {"efficiency": Efficiency(memory=0.5).to_dict() | {"added_later": 1}, "cost": cost.to_dict(),
                  "ceilings": {"bandwidth": 3e10, "fp32_flops": 2e11}, "reference_s": 3.5}}
    path.write_text(json.dumps(good))
    assert cal.cached(config, "m").efficiency.memory == 0.5
    path.write_text(json.dumps(good | {key: good[key] | {"ceilings": None}}))  # as an entry from before ceilings
    assert cal.cached(config, "m").bandwidth is None
    path.write_text(json.dumps(damage(good, key)))
    assert cal.cached(config, "m") is None


def test_calibrating_without_saving_writes_no_cache(tiny_model_dir, tmp_path, monkeypatch):
    from pagedkv.config.engine import EngineConfig
    from pagedkv.planner import cpu
    from pagedkv.sim import calibrate as cal

    monkeypatch.setattr(cal, "cache_path", lambda: tmp_path / "sim_calibration.json")
    monkeypatch.setattr(cpu, "cache_path", lambda: tmp_path / "cpu.json")
    monkeypatch.setattr(cpu, "READ_BYTES", 8 * 2**20)
    r = cal.calibrate(EngineConfig(model=str(tiny_model_dir), num_blocks=64, block_size=16), quick=True, save=False)
    assert r["ceilings"]["bandwidth"] > 0 and not list(tmp_path.iterdir())


# ---- speculative decoding ---------------------------------------------------------------
def test_alpha_for_inverts_the_mean_acceptance():
    from pagedkv.sim.spec import alpha_for, mean_acceptance

    for k in (1, 3, 8):
        for rate in (0.0, 0.2, 0.55, 0.9, 1.0):
            assert abs(mean_acceptance(alpha_for(rate, k), k) - rate) < 1e-9
    assert alpha_for(0.5, 1) == pytest.approx(0.5)  # one draft: the rate is alpha


def _spec_run(rate=None, model=None, **kw):
    sc = {"num_speculative_tokens": 4} | ({"model": model} if model else {"method": "ngram"})
    flags = dict(speculative_config=sc, spec_acceptance_rate=rate) if rate is not None else {}
    return simulate("llama-3-70b", "a100-80gb-sxm4", tp=4, workload="random", num_prompts=24, request_rate=1.0,
                    input_len=256, output_len=96, **flags, **kw)


def test_speculation_accepts_drafts_at_the_rate_given_and_shortens_tpot():
    """The scheduler's own draft handling, with accepted counts drawn at the rate: the
    counted rate lands near it, every request still gets exactly its output tokens, and at a
    low request rate (memory-bound steps) TPOT drops by about the tokens per verification."""
    plain, spec = _spec_run(), _spec_run(0.6)
    sd = spec.metrics["spec_decode"]
    assert abs(sd["acceptance_rate"] - 0.6) < 0.05 and sd["num_draft_tokens"] > 1000
    assert spec.metrics["output_tokens"] == plain.metrics["output_tokens"] == 24 * 96
    speedup = plain.metrics["tpot_s"]["p50"] / spec.metrics["tpot_s"]["p50"]
    assert 0.7 * sd["mean_acceptance_length"] < speedup <= sd["mean_acceptance_length"] * 1.05
    none = _spec_run(0.0)
    assert none.metrics["spec_decode"]["num_accepted_tokens"] == 0
    assert none.metrics["tpot_s"]["p50"] >= plain.metrics["tpot_s"]["p50"]  # verifying 4 more tokens costs
    # a lone request's verify step is a decode, not a 5-token prefill: lone-prefill factors leave
    # its TPOT alone (they reach only the prompts' prefills)
    def alone(efficiency):  # requests far apart: every step holds one request
        return simulate("llama-3-70b", "a100-80gb-sxm4", tp=4, workload="random", num_prompts=6, request_rate=0.01,
                        input_len=256, output_len=32,
                        speculative_config={"num_speculative_tokens": 4, "method": "ngram"},
                        spec_acceptance_rate=0.6, efficiency=efficiency).metrics
    base, slow = alone(Efficiency()), alone(Efficiency(prefill_factors=((1, 50.0),)))
    assert slow["tpot_s"]["p50"] == pytest.approx(base["tpot_s"]["p50"], rel=1e-9)
    assert slow["ttft_s"]["p50"] > 30 * base["ttft_s"]["p50"]  # the prompts' prefills took the factor


def test_a_draft_model_costs_its_own_steps_and_shares_the_pool():
    """With a draft model each step also runs the draft k times, and pages hold both
    models' KV: at acceptance 0 it only costs (TPOT above plain), and the pool is smaller:
    the draft's weights come off the budget, and each page holds both models' tokens."""
    plain, draft0, draft = _spec_run(), _spec_run(0.0, "llama-3-8b"), _spec_run(0.7, "llama-3-8b")
    assert draft0.metrics["tpot_s"]["p50"] > 1.3 * plain.metrics["tpot_s"]["p50"]
    assert draft.metrics["tpot_s"]["p50"] < plain.metrics["tpot_s"]["p50"]
    budget = plain.settings["cache_budget_bytes"]
    draft_weights = 8_030_261_248 * 2 / 4  # llama-3-8b in bfloat16, a quarter a device at tp 4
    ratio = plain.settings["num_blocks"] / draft.settings["num_blocks"]
    assert ratio == pytest.approx((327_680 + 131_072) / 327_680 * budget / (budget - draft_weights), rel=0.01)
    with pytest.raises(ValueError, match="the weights with the draft model's"):  # 405B beside 70B on 4 A100s
        _spec_run(0.7, "llama-3.1-405b")


def test_the_cpu_tier_reloads_evicted_prefixes_over_the_host_link():
    """A shared prefix that the small device cache evicts comes back from the CPU tier: the
    engine's tier bookkeeping decides, the host link prices each page (a PCIe L4)."""
    kw = dict(workload="shared-prefix", num_prompts=48, request_rate=math.inf, kv_cache_memory="256MiB")
    plain = simulate("llama-3-8b", "l4", **kw)
    tier = simulate("llama-3-8b", "l4", kv_offload_memory="4GiB", **kw)
    off = tier.metrics["kv_offload"]
    assert off["blocks_saved"] > 0 and off["blocks_loaded"] > 0 and off["hit_tokens"] == 16 * off["blocks_loaded"]
    page = load_model("llama-3-8b").kv_spec("bfloat16", 16).page_size_bytes
    assert off["load_seconds"] == pytest.approx(off["blocks_loaded"] * page / get_device("l4").host_link)
    assert "kv_offload" not in plain.metrics
    swap = simulate("llama-3-8b", "l4", kv_offload_memory="4GiB", preemption_mode="swap", **kw).metrics
    assert swap["preemptions"] == 0 or swap["kv_offload"]["swap_outs"] > 0


def test_the_disk_tier_catches_what_the_cpu_tier_evicts(tmp_path):
    """A CPU tier too small for the repeated prompts pushes them to the disk tier (the engine's
    DiskPlan, writes on the virtual clock), lookups find them there, and each disk page
    costs the planner's figure: NVMe read, then the host link. The directory is not used."""
    prompts = [tuple(range(1000 * i + 1, 1000 * i + 513)) for i in range(8)]  # 32 pages each, 4 fit the device
    work = [BenchRequest(p, 16, 16, t) for t in (0.0, 100.0) for p in prompts]  # each again once all ended
    kw = dict(workload=work, kv_cache_memory="256MiB", kv_offload_memory="64MiB")  # a 32-page CPU tier
    cpu_only = simulate("llama-3-8b", "l4", **kw).metrics
    both = simulate("llama-3-8b", "l4", kv_offload_dir=str(tmp_path / "unused"), kv_offload_disk_size="4GiB", **kw)
    off = both.metrics["kv_offload"]
    assert off["disk_blocks_written"] > 0 and off["disk_blocks_loaded"] > 0
    assert off["disk_hit_tokens"] == 16 * off["disk_blocks_loaded"]
    assert off["hit_tokens"] + off["disk_hit_tokens"] > cpu_only["kv_offload"]["hit_tokens"]  # what the CPU lost
    assert both.metrics["ttft_s"]["mean"] < cpu_only["ttft_s"]["mean"]
    planned = plan("llama-3-8b", "l4", kv_cache_memory="256MiB", kv_offload_memory="64MiB",
                   kv_offload_disk_size="4GiB")
    assert both.settings["disk_block_load_s"] == pytest.approx(planned.offload_disk_block_load_seconds)
    assert off["disk_capacity_blocks"] == planned.offload_disk_blocks
    assert not (tmp_path / "unused").exists()


def test_simulated_disk_writes_queue_on_one_writer():
    """Writes start after the step's copies before the forward, one after another at the
    write rate, and each is reported done at the first step end after it finishes."""
    from pagedkv.connectors.offload.cpu_tier_worker import OffloadMeta
    from pagedkv.sim.tier import SimTierWorker, TierCosts

    w = SimTierWorker(TierCosts(page_bytes=100, link=1000.0, disk_load_s=0.5, disk_write_s=1.0), disk=True)
    meta = OffloadMeta(1)
    meta.loads, meta.disk_loads = [(0, 1)], [(b"x", (1,), 2)]
    meta.disk_writes = [(0, b"a", b"r", (1,)), (1, b"b", b"a", (2,))]
    assert w.price(meta, start=10.0) == (0.1 + 0.5, 0.0)  # one CPU page over the link, one disk page
    assert w.finish(11.0)[3] == ([], [], [])               # writes end at 11.6 and 12.6
    w.price(OffloadMeta(2), start=11.0)
    assert w.finish(12.0)[3] == ([b"a"], [], [])
    nxt = OffloadMeta(3)
    nxt.disk_writes = [(2, b"c", b"b", (3,))]
    w.price(nxt, start=12.0)                               # queued behind b: ends at 13.6
    assert w.finish(13.0)[3] == ([b"b"], [], []) and w.finish(14.0)[3] == ([b"c"], [], [])


def test_the_cost_model_line_names_the_measured_corrections():
    from pagedkv.sim.report import _corrections

    eff = Efficiency(few_row_factors=(1.3, 0.9), prefill_factors=((16, 0.8), (2048, 1.1)), idle_wake_s=0.003).to_dict()
    assert _corrections(eff) == (", decodes of 1-2 requests x0.90-1.30, lone prefills x0.80-1.10 (2 lengths), "
                                 "+3.00 ms after idle")
    assert _corrections(Efficiency().to_dict()) == ""


def test_one_token_outputs_count_the_pages_their_prefill_held():
    """A request that ends in its prefill step frees its pages in that step's update: the
    peak is taken before the step runs, so it is the prompt's blocks, not 0."""
    from pagedkv.bench.workloads import BenchRequest

    reqs = [BenchRequest((5,) * 40, 1, 1, arrival_s=0.0)]
    r = simulate("llama-3-8b", "a100-80gb-sxm4", workload=reqs, block_size=16)
    assert r.metrics["output_tokens"] == 1 and r.metrics["peak_kv_blocks"] == 3  # ceil(40 / 16)
