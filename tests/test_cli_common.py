"""Engine flags are generated from EngineConfig: names, defaults and help come from the
dataclass, so every subcommand that takes them agrees with ``EngineConfig()``."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.cli import build_parser
from pagedkv.cli_common import FLAG_OPTIONS, attribute_docs, engine_fields, engine_kwargs, help_text
from pagedkv.config.engine import EngineConfig

ENGINE_COMMANDS = [["generate"], ["serve"]] + [["bench", c] for c in
                                                ("throughput", "online", "latency", "prefix")]
VLLM_FLAGS = ["--block-size", "--kv-cache-dtype", "--max-num-seqs", "--max-num-batched-tokens",
              "--max-model-len", "--enable-prefix-caching", "--no-enable-prefix-caching",
              "--kv-cache-memory", "--num-blocks"]


def _engine_actions(argv: list[str]) -> dict:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[argv[0]]
    for name in argv[1:]:
        sub = sub._subparsers._group_actions[0].choices[name]
    return {s: a for a in sub._actions for s in a.option_strings}


@pytest.mark.parametrize("argv", ENGINE_COMMANDS, ids=" ".join)
def test_flag_defaults_are_the_dataclass_defaults(argv):
    a = build_parser().parse_args(argv)
    assert EngineConfig(**engine_kwargs(a)) == EngineConfig()


def test_capacity_and_eval_keep_their_own_defaults():
    a = build_parser().parse_args(["bench", "capacity"])
    assert engine_kwargs(a)["kv_cache_memory"] == "128MiB"
    a = build_parser().parse_args(["eval", "ppl", "--file", "x.txt"])
    assert a.kv_cache_dtype == "float32,int8,fp8_e4m3" and a.block_size == 16


@pytest.mark.parametrize("argv", ENGINE_COMMANDS + [["eval", "agreement"], ["bench", "capacity"]], ids=" ".join)
def test_every_field_is_a_flag_with_vllm_names(argv):
    actions = _engine_actions(argv)
    assert set(VLLM_FLAGS) <= set(actions)
    flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig)}
    assert flags - set(actions) == {"--debug-invariants"}
    assert all(actions[f].help for f in flags - {"--debug-invariants"})


def test_flag_values_reach_the_config():
    a = build_parser().parse_args(["generate", "--block-size", "32", "--kv-cache-dtype", "fp8",
                                   "--no-enable-prefix-caching", "--kv-cache-memory", "64MiB",
                                   "--max-model-len", "100", "--kv-allocator", "contiguous", "hi"])
    cfg = EngineConfig(**engine_kwargs(a))
    assert (cfg.block_size, cfg.kv_cache_dtype, cfg.enable_prefix_caching) == (32, "fp8_e4m3", False)
    assert (cfg.kv_cache_memory, cfg.max_model_len, cfg.kv_allocator) == (64 * 2**20, 100, "contiguous")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-dtype", "int3", "hi"])


def test_help_comes_from_the_docstring():
    docs = attribute_docs(EngineConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(EngineConfig)}
    actions = _engine_actions(["generate"])
    assert "ignored when --num-blocks is set (default: 4GiB on the CPU" in actions["--kv-cache-memory"].help
    assert "%(default)s" not in actions["--kv-cache-memory"].help  # None: the docstring says what happens
    assert actions["--block-size"].help.endswith("(default: %(default)s)")
    assert actions["--enable-prefix-caching"].help.endswith("(default: on)")
    assert "default" not in actions["--num-blocks"].help       # None: no default to show
    assert "%(default)s" not in actions["--max-model-len"].help  # the docstring says it
    assert actions["--kv-cache-dtype"].choices == FLAG_OPTIONS["kv_cache_dtype"]["choices"]


def test_help_text_rules():
    names = {"num_blocks"}
    assert help_text("a ``num_blocks`` and ``auto`` and :mod:`x.y`.", names, 5) == \
        "a --num-blocks and auto and x.y (default: %(default)s)"
    assert help_text("100% sure", names, None) == "100%% sure"
    assert help_text("x (default: the model's)", names, 5) == "x (default: the model's)"
    assert help_text("flag", names, False) == "flag" and help_text("flag", names, True) == "flag (default: on)"
    assert [f.name for f in engine_fields()][:3] == ["model", "block_size", "kv_cache_dtype"]
