"""``pagedkv bench`` end to end on the tiny random model: the driver, the JSON document,
the CLI's parsing and errors. Runs in seconds (tiny model, few short prompts, quick
machine measurement)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedkv.bench import report
from pagedkv.bench.cli import add_parser, main
from pagedkv.bench.driver import drive
from pagedkv.bench.workloads import BenchRequest


@pytest.fixture()
def tiny_engine(tiny_model_dir):
    from pagedkv.engine.engine import LLMEngine

    def make(**kw):
        kw.setdefault("num_blocks", 64)
        return LLMEngine(model=str(tiny_model_dir), debug_invariants=True, **kw)
    return make


def _reqs(n, prompt_len, output_len, max_tokens, gap=0.0):
    return [BenchRequest(tuple(range(10 + i, 10 + i + prompt_len)), output_len, max_tokens, gap * i) for i in range(n)]


# ---- the driver ------------------------------------------------------------------------
def test_drive_ends_requests_at_output_len_and_frees_pages(tiny_engine):
    engine = tiny_engine()
    run = drive(engine, _reqs(4, 20, output_len=3, max_tokens=10))
    assert sorted(r.index for r in run.records) == [0, 1, 2, 3]
    assert all(r.num_output_tokens == 3 and r.finish_reason == "length" for r in run.records)
    assert engine.kv_manager.usage().used == 0 and not engine.has_unfinished_requests()
    m = run.metrics()
    assert m["output_tokens"] == 12 and m["max_running"] == 4 and m["peak_kv_blocks"] >= 8
    assert m["prefill_tokens_computed"] == 80
    assert len(run.steps) == len(run.step_seconds) == m["steps"]
    assert 0 <= m["waste"] < 1 and m["samples"] == m["steps"]


def test_one_token_outputs_report_the_pages_their_prefill_held(tiny_engine):
    """Requests that end in their prefill step free their pages inside it: the driver's and
    the engine's peaks are taken when the step is scheduled, not only after it."""
    engine = tiny_engine()
    m = drive(engine, _reqs(2, 20, output_len=1, max_tokens=1)).metrics()
    assert m["output_tokens"] == 2 and m["peak_kv_blocks"] == 4  # two prompts of 20 tokens, 16-token blocks
    assert engine.peak_blocks_used >= 4 and engine.kv_manager.usage().used == 0


def test_contiguous_wastes_more_and_runs_fewer_at_once(tiny_engine):
    work = _reqs(8, 20, output_len=4, max_tokens=100)    # reserves 120 slots, uses 24
    paged = drive(tiny_engine(num_blocks=20), work).metrics()
    contig = drive(tiny_engine(num_blocks=20, kv_allocator="contiguous"), work).metrics()
    assert contig["waste"] > 0.5 > paged["waste"]
    assert paged["max_running"] >= 2 * contig["max_running"]
    assert paged["output_tokens"] == contig["output_tokens"] == 32


def test_online_arrivals_are_injected_by_time(tiny_engine):
    run = drive(tiny_engine(), _reqs(3, 8, 2, 2, gap=0.15))
    arrivals = sorted(r.arrival for r in run.records)
    assert arrivals[1] - arrivals[0] == pytest.approx(0.15, abs=1e-6)
    assert all(r.ttft >= 0 for r in run.records)
    assert run.duration_s >= 0.3


# ---- the CLI and the JSON document -----------------------------------------------------
def _bench(tmp_path, tiny_model_dir, capsys, *args):
    out = tmp_path / "r.json"
    rc = main(["bench", *args, "--model", str(tiny_model_dir), "--quick-measure", "--no-progress",
               "--output", str(out), "--num-blocks", "128"])
    text = capsys.readouterr().out
    assert rc == 0
    return json.loads(out.read_text()), text


def test_throughput_end_to_end_json_and_plot(tmp_path, tiny_model_dir, capsys):
    doc, text = _bench(tmp_path, tiny_model_dir, capsys, "throughput", "--num-prompts", "3",
                       "--max-prompt-tokens", "48", "--max-tokens", "4", "--systems", "pagedkv,contiguous,hf",
                       "--plot", str(tmp_path / "p.png"))
    report.validate(doc)
    assert doc["schema"] == report.SCHEMA and doc["command"] == "throughput"
    assert doc.get("complete", True)            # the final write replaces the per-run checkpoints
    assert {r["system"] for r in doc["runs"]} == {"pagedkv", "contiguous", "hf"}
    for r in doc["runs"]:
        m = r["metrics"]
        assert m["output_tokens"] == 12 and m["num_requests"] == 3
        for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert set(m[k]) == {"mean", "p50", "p90", "p99", "n"}
        assert 0 < r["roofline"]["fraction_of_ideal"] and r["roofline"]["bound_s"] > 0
    pk = doc["summary"]["pagedkv"]
    for k in ("metrics.requests_per_s", "metrics.total_tokens_per_s", "metrics.waste", "metrics.peak_kv_blocks",
              "metrics.max_running", "metrics.preemptions", "metrics.ttft_s.p99"):
        assert k in pk
    assert doc["machine"]["read_bandwidth"] > 0 and doc["machine"]["fp32_flops"] > 0
    probes = doc["machine"]["probes"]                # ceilings measured again before every run
    assert len(probes) == 3 and all(p["fp32_flops"] <= doc["machine"]["fp32_flops"] for p in probes)
    assert {"pagedkv/hf output tok/s", "pagedkv/contiguous output tok/s"} <= set(doc["ratios"])
    assert [g["name"] for g in doc["goals"]][0] == "output tok/s vs HF static batching"
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert "| output tok/s |" in text and "MET" in text


def test_prefix_end_to_end(tmp_path, tiny_model_dir, capsys):
    doc, text = _bench(tmp_path, tiny_model_dir, capsys, "prefix", "--num-prompts", "4", "--prefix-tokens", "64",
                       "--question-tokens", "8", "--max-tokens", "2", "--replay-conversations", "2",
                       "--replay-turns", "2", "--replay-max-tokens", "4", "--max-prompt-tokens", "480")
    on, off = doc["summary"]["prefix-caching-on"], doc["summary"]["prefix-caching-off"]
    assert on["metrics.rest_cached_tokens"] >= 3 * 64 and off["metrics.rest_cached_tokens"] == 0
    assert on["metrics.prefill_tokens_computed"] < off["metrics.prefill_tokens_computed"]
    replay = doc["replay"]
    assert replay["conversations"] == 2 and replay["requests"] == 4
    assert 0 < replay["hit_rate_turns_2plus"] <= replay["possible_hit_rate_turns_2plus"] <= 1
    assert "multi-turn replay" in text


def test_latency_runs_one_stream_and_skips_a_llama_cpp_it_cannot_run(tmp_path, tiny_model_dir, capsys):
    """llama.cpp needs a GGUF: for a Hugging Face folder (or without llama-cpp-python) the
    baseline is skipped with its reason, and pagedkv's single-stream runs still land."""
    doc, text = _bench(tmp_path, tiny_model_dir, capsys, "latency", "--num-prompts", "2", "--max-prompt-tokens", "48",
                       "--max-tokens", "4", "--systems", "pagedkv,llama-cpp")
    assert {r["system"] for r in doc["runs"]} == {"pagedkv"} and "llama-cpp" in doc["skipped"]
    assert doc["summary"]["pagedkv"]["metrics.decode_tokens_per_s"] > 0
    assert "single-stream decode vs llama.cpp" not in text


def test_help_lists_commands_and_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("throughput", "capacity", "online", "latency", "prefix", "examples:"):
        assert word in out
    with pytest.raises(SystemExit):
        main(["bench", "capacity", "--help"])
    assert "(default: 128MiB)" in capsys.readouterr().out


@pytest.mark.parametrize("args, fragment", [
    (["throughput", "--systems", "pagedkv,vllm"], "unknown system(s) vllm"),
    (["throughput", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["online", "--request-rate", "-1"], "--request-rate must be positive"),
    (["throughput", "--block-size", "0"], "block_size must be a positive integer"),
])
def test_bad_input_is_one_line_error(args, fragment, capsys):
    assert main(["bench", *args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0]


def test_add_parser_registers_on_the_main_cli_parser():
    from pagedkv.cli import _Parser

    parser = _Parser(prog="pagedkv")
    add_parser(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    a = parser.parse_args(["bench", "capacity", "--repeats", "3"])
    assert a.command == "bench" and a.bench_command == "capacity" and a.repeats == 3
    assert a.kv_cache_memory == "128MiB" and a.dataset == "hh-rlhf" and callable(a.func)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "nosuch"])
    assert isinstance(a, argparse.Namespace)


def test_llama_cpp_batched_baseline_equals_its_sequences_run_alone(default_model_files):
    """The batched llama.cpp baseline (skipped where llama-cpp-python is not installed, as
    in CI): each sequence's greedy tokens in a batch of three equal the same sequence alone."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from pagedkv.bench import llama_cpp_batched
    from pagedkv.bench.workloads import BenchRequest
    from pagedkv.model.loader import _packaged_gguf

    gguf = _packaged_gguf("smollm2-135m-instruct")
    work = [BenchRequest(tuple(range(300 + i, 340 + 7 * i)), 6, 6) for i in range(3)]
    records, seconds, batched = llama_cpp_batched.run_batched(llama_cpp, gguf, work, 2)
    assert [len(r.token_times) for r in records] == [6, 6, 6] and seconds > 0
    for w, out in zip(work, batched):
        assert llama_cpp_batched.run_batched(llama_cpp, gguf, [w], 2)[2] == [out]
