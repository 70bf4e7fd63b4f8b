"""``pagedkv plan`` through its argparse entry: JSON keys, text, lists, sweep, plot, one-line errors."""

import argparse
import dataclasses
import json

import pytest

from pagedkv.planner.cli import add_parser
from pagedkv.planner.result import PlanResult


def run(capsys, *argv):
    parser = argparse.ArgumentParser(prog="pagedkv")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_parses_with_documented_keys(capsys):
    rc, out, err = run(capsys, "--model", "llama-3-70b", "--gpu", "h100-sxm", "--tp", "2", "--json")
    data = json.loads(out)
    assert rc == 0 and err == ""
    assert set(data) == {f.name for f in dataclasses.fields(PlanResult)}
    assert data["bytes_per_token"] == 327_680 and data["kv_cache_dtype"] == "bfloat16"
    assert {"seconds", "memory_seconds", "compute_seconds", "limited_by"} <= set(data["decode"])
    assert data["batch_sweep"][0]["batch"] == 1


def test_point7_json_num_blocks(capsys):
    rc, out, _ = run(capsys, "--model", "smollm2-135m-instruct", "--kv-cache-memory", "256MiB",
                     "--block-size", "16", "--json")
    assert rc == 0 and json.loads(out)["num_blocks"] == 363  # 364 pages fit; page 0 is the null page


def test_text_report_labels_gb_and_gib(capsys):
    rc, out, _ = run(capsys, "--model", "llama-3-70b", "--gpu", "a100-80gb-sxm4", "--kv-cache-dtype", "fp16",
                     "--weight-dtype", "fp16", "--batch", "32")
    assert rc == 0
    assert "1,342,177,280 B (1.34 GB, 1.25 GiB)" in out and "42,949,672,960 B (42.9 GB, 40.0 GiB)" in out
    assert "weights do not fit" in out and "--tp 2" in out


def test_lists(capsys):
    rc, out, _ = run(capsys, "--list-models")
    assert rc == 0 and "deepseek-v3" in out and "MLA" in out and "huggingface.co" in out
    rc, out, _ = run(capsys, "--list-gpus")
    assert rc == 0 and "mi300x" in out and "rtx-4090" in out
    rc, out, _ = run(capsys, "--list-gpus", "--json")
    assert rc == 0 and len(json.loads(out)["gpus"]) >= 10


def test_sweep(capsys):
    rc, out, _ = run(capsys, "--sweep", "--model", "llama-3-8b,llama-3-70b", "--gpu", "l4,h200", "--json")
    cells = json.loads(out)
    assert rc == 0 and len(cells) == 4
    seventy_on_l4 = next(c for c in cells if c["model"] == "llama-3-70b" and c["gpu"] == "l4")
    assert seventy_on_l4["tp"] > 1 and seventy_on_l4["weights_fit"]  # raised to the smallest TP that fits
    rc, out, _ = run(capsys, "--sweep", "--model", "llama-3-8b", "--gpu", "h200")
    assert rc == 0 and "llama-3-8b" in out and "GiB" in out


def test_plot_writes_png(capsys, tmp_path):
    path = tmp_path / "plan.png"
    rc, out, _ = run(capsys, "--model", "llama-3-8b", "--gpu", "l40s", "--plot", str(path), "--plot-batches", "1,4")
    assert rc == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "unknown model"),
    (["--gpu", "v100"], "unknown GPU"),
    (["--gpu", "a100-sxm5"], "no A100 SXM5"),
    (["--seq-len", "-5"], "--seq-len must be >= 1"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--batch", "many"], "--batch must be an integer"),
    (["--kv-cache-dtype", "fp7"], "unknown kv cache dtype"),
    (["--kv-heads", "4"], "--kv-heads must divide"),
    (["--tp", "3", "--model", "llama-3-8b", "--kv-heads", "2"], "does not split"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--kv-cache-memory", "lots"], "cannot parse size"),
    (["--plot", "x.png"], "--plot needs --gpu"),
])
def test_bad_input_is_one_error_line_and_exit_2(capsys, argv, message):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_malformed_config_json_is_one_error_line(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 2,')
    rc, _, err = run(capsys, "--model", str(bad))
    assert rc == 2 and err.startswith("error: cannot read") and err.count("\n") == 1


def test_help_has_examples(capsys):
    parser = argparse.ArgumentParser(prog="pagedkv")
    add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "--kv-cache-memory 256MiB" in out


def test_module_entry_point(capsys):
    from pagedkv.planner.__main__ import main
    assert main(["--model", "falcon-7b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"] == "MQA"


@pytest.mark.parametrize("argv,hint", [
    (("--kv-cache-memory", "100MiB", "--batch", "4"), "none of the 4 requests of 4,096 tokens fit in the cache; "
                                                       "they need a cache of about 2,147,483,648 B"),  # not "--tp 1"
    (("--kv-cache-memory", "1KiB"), "the request of 4,096 tokens does not fit in the cache; it needs"),
    (("--batch", "100", "--seq-len", "8192"), "all 100 fit with --tp 2"),
])
def test_a_batch_that_does_not_fit_gets_a_hint_that_changes_something(capsys, argv, hint):
    rc, out, _ = run(capsys, "--model", "llama-3-8b", "--gpu", "h100-sxm", *argv)
    assert rc == 0 and hint in out and "fit with --tp 1" not in out


def test_a_budget_that_holds_no_block_is_flagged(capsys):
    rc, out, _ = run(capsys, "--model", "smollm2-135m-instruct", "--kv-cache-memory", "1MiB")
    assert rc == 0 and "holds no KV block beside the reserved null page: the engine refuses it" in out
    assert "--tp up to 64" not in out  # no --gpu: no TP search was made


def test_weights_that_do_not_fit_get_one_hint_not_a_budget_one(capsys):
    """A new user planning Llama-3-70B on one H100 was told to raise --kv-cache-memory too,
    which cannot help: the weights note says what does (--tp 2)."""
    rc, out, _ = run(capsys, "--model", "llama-3-70b", "--gpu", "h100-sxm", "--seq-len", "8192")
    assert rc == 0 and "fits with --tp 2" in out and "holds no KV block" not in out
