"""The disaggregated prefill/decode simulation (issue 16): the engine's scheduler on each
instance's own virtual clock, KV crossing at the link's rate, decode instances computing no
prompt, every page back at the end."""

from __future__ import annotations

import pytest

from pagedkv.bench.workloads import BenchRequest
from pagedkv.sim.disagg import run_disagg
from pagedkv.sim.run import prepare, sim_model
from pagedkv.sim.runner import SimRunner

MODEL, GPU = "llama-3-8b", "h100-sxm"


def setup_and_requests(rate=2.0, n=40):
    setup, reqs = prepare(MODEL, GPU, 1, {}, "auto", 0.9, None, None, "random", n, rate,
                          dict(max_prompt_tokens=4096, max_tokens=64, input_len=1000, output_len=32,
                               range_ratio=0.0, trace=None, seed=0))
    s = setup.settings
    page = sim_model(MODEL).kv_spec(s["kv_cache_dtype"], s["block_size"]).page_size_bytes
    return setup, reqs, page, s["block_size"]


def test_every_request_finishes_and_every_page_comes_back(monkeypatch):
    computed: dict[int, int] = {}  # tokens each runner computed
    execute = SimRunner.execute

    def counting(self, out):
        computed[id(self)] = computed.get(id(self), 0) + out.total_num_scheduled_tokens
        return execute(self, out)

    monkeypatch.setattr(SimRunner, "execute", counting)
    setup, reqs, page, bs = setup_and_requests()
    r = run_disagg(setup, reqs, 2, 1, 50e9, page, bs, 1.0, 0.05)
    assert all(len(rec.token_times) == q.max_tokens for rec, q in zip(r.records, reqs))
    assert all(e.kv_manager.pool.num_used == 0 for e in r.prefill_engines + r.decode_engines)
    (dec,) = r.decode_engines  # each prompt's last token, then the outputs but the last: no prompt computed
    assert computed[id(dec.runner)] == sum(1 + q.max_tokens - 1 for q in reqs)
    assert sum(computed[id(e.runner)] for e in r.prefill_engines) == sum(len(q.prompt_token_ids) for q in reqs)
    assert r.metrics["slo_attainment"] == 1.0


def test_the_transfer_is_on_the_critical_path():
    setup, reqs, page, bs = setup_and_requests(rate=0.5, n=10)  # light load: no queueing
    fast = run_disagg(setup, reqs, 1, 1, 1e12, page, bs, 10.0, 1.0)
    slow_link = 1e9  # 1 GB/s: 1,000 tokens of KV take tens of milliseconds
    slow = run_disagg(setup, reqs, 1, 1, slow_link, page, bs, 10.0, 1.0)
    moved = -(-1000 // bs) * page / slow_link
    for a, b in zip(fast.records, slow.records):
        assert b.ttft - a.ttft == pytest.approx(moved - moved * 1e9 / 1e12, rel=0.05)


def test_colocated_instances_compute_their_own_prompts():
    setup, reqs, page, bs = setup_and_requests()
    r = run_disagg(setup, reqs, 2, 0, 50e9, page, bs, 1.0, 0.05)
    assert r.decode_engines == [] and all(len(rec.token_times) == q.max_tokens for rec, q in zip(r.records, reqs))
    assert r.metrics["instances"] == {"prefill": 2, "decode": 0}


def test_bad_arguments():
    setup, reqs, page, bs = setup_and_requests(n=2)
    with pytest.raises(ValueError):
        run_disagg(setup, reqs, 0, 1, 50e9, page, bs, 1.0, 0.05)
    with pytest.raises(ValueError):
        run_disagg(setup, reqs, 1, 1, 0.0, page, bs, 1.0, 0.05)
    with pytest.raises(ValueError):  # a request that can never fit is refused, as the engine does
        run_disagg(setup, [BenchRequest(tuple(range(10**6)), 8, 8)], 1, 1, 50e9, page, bs, 1.0, 0.05)


@pytest.mark.parametrize("spec, expect", [("2P1D", (2, 1)), ("1p3d", (1, 3)), (" 10P2D ", (10, 2))])
def test_parse_disagg(spec, expect):
    from pagedkv.sim.disagg import parse_disagg

    assert parse_disagg(spec) == expect


@pytest.mark.parametrize("spec", ["2P0D", "0P1D", "2X", "", "P1D", "2P1"])
def test_parse_disagg_refuses(spec):
    from pagedkv.sim.disagg import parse_disagg

    with pytest.raises(ValueError, match="XPYD"):
        parse_disagg(spec)


def test_simulate_cli_compares_disaggregated_with_colocated(capsys):
    import json

    from pagedkv.cli import main

    args = ["simulate", "--model", MODEL, "--gpu", GPU, "--workload", "random", "--random-input-len", "1000",
            "--random-output-len", "32", "--num-prompts", "30", "--request-rate", "4"]
    assert main(args + ["--disagg", "1P1D", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["setup"]: r for r in doc["rows"]}
    assert set(rows) == {"1P1D", "colocated x2"}
    setup, reqs, page, bs = setup_and_requests(rate=4.0, n=30)
    want = run_disagg(setup, reqs, 1, 1, 400e9 / 8, page, bs, 1.0, 0.05).metrics
    assert rows["1P1D"]["ttft_p50_s"] == pytest.approx(want["ttft_s"]["p50"])
    assert rows["1P1D"]["slo_attainment"] == want["slo_attainment"]
    assert main(args + ["--disagg", "1P1D", "--sweep"]) == 2 and "not with --disagg" in capsys.readouterr().err
    assert main(args + ["--disagg", "3P"]) == 2 and "XPYD" in capsys.readouterr().err
