"""``pagedkv info``: the model folder other tools need, its KV bytes per token (the same
arithmetic the engine sizes its cache with) and the kernel's state; one-line errors."""

from __future__ import annotations

import json

from pagedkv.cli import main
from pagedkv.model.loader import resolve_model


def test_info_json_points_at_the_folder_and_counts_kv_bytes(tiny_model_dir, capsys):
    assert main(["info", "--model", str(tiny_model_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    cfg = resolve_model(str(tiny_model_dir)).config
    assert info["folder"] == str(tiny_model_dir) and info["files"]["tokenizer.json"]
    # tiny model: 2 layers x 2 KV heads x head_dim 16 x (K + V) x 4 bytes
    assert info["kv_bytes_per_token"]["float32"] == 2 * 2 * 16 * 2 * 4 == cfg.kv_spec("float32").bytes_per_token
    assert info["kv_bytes_per_token"]["float16"] * 2 == info["kv_bytes_per_token"]["float32"]
    assert info["size_bytes"] > 0 and set(info["kernel"]) >= {"built", "build_directory"}


def test_info_text_names_the_folder_for_lm_eval(tiny_model_dir, capsys):
    assert main(["info", "--model", str(tiny_model_dir)]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer={tiny_model_dir}" in out and "KV bytes/token" in out


def test_info_unknown_model_is_one_line(capsys):
    assert main(["info", "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "neither a known name" in err and len(err.strip().splitlines()) == 1
