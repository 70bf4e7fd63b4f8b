"""Measured GPU cost-model factors: loading, use by the simulator, and the GPU profile script off a GPU."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.planner.hardware import get_device
from pagedkv.planner.models import load_model
from pagedkv.planner.roofline import chunk_work, config_cost
from pagedkv.sim.cost import Efficiency, StepCost
from pagedkv.sim.gpu_fits import bundled, load_efficiency
from pagedkv.sim.run import simulate

REPO = Path(__file__).resolve().parents[1]


def test_roofline_bundled_and_file_factors(tmp_path):
    assert load_efficiency("roofline") == Efficiency()
    e = load_efficiency("h200/llama-3-8b")
    assert "H200" in e.source and 0 < e.memory < 1 and e.kv_read is not None and e.step_overhead_s > 0
    flat, nested = tmp_path / "flat.json", tmp_path / "nested.json"
    flat.write_text(json.dumps({"memory": 0.5, "compute": 0.25}))
    nested.write_text(json.dumps({"efficiency": {"memory": 0.5, "step_overhead_s": 1e-3, "source": "mine"}}))
    assert load_efficiency(str(flat)) == Efficiency(memory=0.5, compute=0.25, source=f"given in {flat}")
    assert load_efficiency(str(nested)) == Efficiency(memory=0.5, step_overhead_s=1e-3, source="mine")


@pytest.mark.parametrize("content,message", [
    ("not json", "not readable JSON"), ("[1, 2]", "JSON object"), ('{"memory": 2.0}', "memory efficiency"),
    ('{"memroy": 0.5}', "unknown efficiency field"), ('{"kv_read": 0.5}', "both set"),
    ("[" * 100_000 + "]" * 100_000, "not readable JSON"), ('{"memory": true}', "memory efficiency"),
    ('{"step_overhead_s": true}', "step_overhead_s"), ('{"step_overhead_s": Infinity}', "step_overhead_s"),
    ('{"request_overhead_s": 1' + "0" * 400 + "}", "request_overhead_s"),
    ('{"few_row_factors": "123"}', "few_row_factors"), ('{"few_row_factors": {"1": 2}}', "few_row_factors"),
    ('{"few_row_factors": ["1.5"]}', "few_row_factors"), ('{"few_row_kv_factors": [1e308]}', "few_row_kv"),
    ('{"source": ["a"]}', "source must be a string")])
def test_bad_factor_files_are_one_clear_error(tmp_path, content, message):
    f = tmp_path / "e.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_efficiency(str(f))
    with pytest.raises(ValueError, match="bundled fit"):
        load_efficiency("h300/llama-3-8b")


def _priced_errors(fit: dict, raw: dict) -> list[float]:
    base, _, tp = fit["model"].partition(":tp")
    tp, m = int(tp or 1), load_model(base)
    cost = StepCost(config_cost(m, m.kv_spec("bfloat16", 16, tp), "bfloat16", tp), get_device(fit["gpu"]),
                    "bfloat16", load_efficiency(fit["name"]))
    errors = []
    for r in (r for r in raw["models"][fit["model"]]["steps"] if r["graph"]):
        per = r["tokens"] // r["batch"]
        chunks = [(r["context"], 1)] * r["batch"] if r["kind"] == "decode" else [(0, per)] * r["batch"]
        errors.append(cost.seconds(chunk_work(chunks, r["batch"]), r["batch"]) / r["seconds"] - 1)
    return errors


@pytest.mark.parametrize("name", sorted(bundled()))
def test_bundled_fits_price_their_measured_steps(name):
    """Each bundled fit, through the simulator's step cost, reproduces the H200 steps it
    was fitted to (benchmarks/results): the cost model and the fit agree on the terms."""
    fit = bundled()[name]
    raw = json.loads((REPO / fit["raw"]).read_text())
    errors = _priced_errors(fit, raw)
    assert len(errors) >= 20
    assert statistics.median(abs(e) for e in errors) == pytest.approx(fit["median_abs_rel_error"], abs=1e-3)
    assert statistics.median(abs(e) for e in errors) < 0.05 and max(abs(e) for e in errors) < 0.2


@pytest.mark.parametrize("bad", [5, 0, False, {}, [0.5], {"memory": 0.5}, b"h200/llama-3-8b"])
def test_python_api_refuses_efficiency_of_another_type(bad):
    with pytest.raises(ValueError, match="an Efficiency"):
        simulate(model="llama-3-8b", gpu="h200", workload="random", num_prompts=2, efficiency=bad)


def test_a_path_object_names_a_file(tmp_path):
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"memory": 0.5}))
    r = simulate(model="llama-3-8b", gpu="h200", workload="random", num_prompts=2, efficiency=f)
    assert r.settings["efficiency"]["memory"] == 0.5


def test_measured_factors_slow_the_simulated_run_and_are_reported(capsys):
    kw = dict(model="llama-3-8b", gpu="h200", workload="random", num_prompts=32, input_len=512, output_len=32)
    roof, fitted = simulate(**kw), simulate(**kw, efficiency="h200/llama-3-8b")
    assert "H200" in fitted.settings["efficiency"]["source"]
    # the fit's decode steps run at about half the roofline (BENCHMARKS.md): TPOT at least 1.5x
    assert fitted.metrics["tpot_s"]["p50"] > 1.5 * roof.metrics["tpot_s"]["p50"]
    assert main(["simulate", "--model", "llama-3-8b", "--gpu", "h200", "--efficiency", "h200/llama-3-8b",
                 "--workload", "random", "--num-prompts", "8", "--json"]) == 0
    assert "CUDA-graph steps" in json.loads(capsys.readouterr().out)["settings"]["efficiency"]["source"]
    assert main(["simulate", "--calibrate", "--efficiency", "h200/llama-3-8b"]) == 2
    assert "not with --calibrate" in capsys.readouterr().err
    assert main(["simulate", "--model", "llama-3-8b", "--gpu", "h200", "--efficiency", "nope"]) == 2
    assert "bundled fit" in capsys.readouterr().err
    # a fit measured for another model or GPU still runs, with one warning line
    assert main(["simulate", "--model", "llama-3-70b", "--tp", "4", "--gpu", "h100-sxm", "--efficiency",
                 "h200/llama-3-8b", "--workload", "random", "--num-prompts", "4", "--json"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: --efficiency h200/llama-3-8b was fitted on h200 to llama-3-8b") and "\n" == err[-1]
    assert err.count("\n") == 1
    with pytest.warns(UserWarning, match="fitted on h200"):
        simulate(model="llama-3-8b", gpu="a100-80gb-sxm4", workload="random", num_prompts=2,
                 efficiency="h200/llama-3-8b")


def test_gpu_profile_script_runs_off_a_gpu(tmp_path):
    """The script the fits come from (run on a GPU machine, where a failure costs device
    time) on a tiny decoder on this CPU: every shape timed, tp shards sized."""
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 256}
    (tmp_path / "tiny.json").write_text(json.dumps({"config": config}))
    out = tmp_path / "steps.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_step_profile.py"), "--device", "cpu",
                        "--dtype", "float32", "--quick", "--models-dir", str(tmp_path), "--model", "tiny",
                        "--model", "tiny:tp2", "--kv-pool-gib", "0.001", "--repeats", "2", "--output", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["ceilings"]["matmul_flops_per_s"] > 0
    for name, heads in (("tiny", 4), ("tiny:tp2", 2)):
        entry = result["models"][name]
        assert entry["shape"]["heads"] == heads and entry["shape"]["kv_heads"] == heads // 2
        kinds = [(s["kind"], s["batch"]) for s in entry["steps"]]
        assert kinds == [("decode", 1), ("decode", 4), ("prefill", 1), ("prefill", 2), ("decode", 1)]
        assert all(s["seconds"] > 0 and len(s["all_seconds"]) == 2 for s in entry["steps"])


def test_gpu_profile_script_refuses_what_its_decoder_is_not(tmp_path):
    """An MoE or MLA model profiled as a dense decoder would fit wrong factors silently."""
    config = {"model_type": "mixtral", "num_local_experts": 8, "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}
    (tmp_path / "moe.json").write_text(json.dumps({"config": config}))
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_step_profile.py"), "--device", "cpu",
                        "--quick", "--models-dir", str(tmp_path), "--model", "moe", "--output",
                        str(tmp_path / "o.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "dense Llama-style decoder" in r.stderr
    assert not (tmp_path / "o.json").exists()
