"""``pagedkv eval ppl | attn-error | agreement``: what a KV storage setting costs in quality.

Each takes ``--kv-cache-dtype`` as a comma-separated list of settings, ``dtype`` or
``dtype:granularity`` (see :mod:`pagedkv.eval.settings`; ``--kv-cache-scale`` is the
granularity of entries without one). ``ppl`` and ``agreement`` compare with the first
setting; ``attn-error`` always measures against the float32 cache.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

EXAMPLES = """examples:
  pagedkv eval ppl --file ../shared/data/wikitext-2-raw/wiki.test.raw --num-tokens 8192 --window 1024 \\
      --kv-cache-dtype float32,int8,int8:per-tensor,fp8_e4m3
  pagedkv eval attn-error --file ../shared/data/wikitext-2-raw/wiki.test.raw --num-tokens 2048 --window 512
  pagedkv eval agreement --num-prompts 16 --max-tokens 64 --kv-cache-dtype float32,int8,fp8_e4m3
"""
DEFAULT_SETTINGS = "float32,float16,int8,int8:per-head,int8:per-tensor,fp8_e4m3,fp8_e5m2"


def add_parser(subparsers) -> argparse.ArgumentParser:
    ev = subparsers.add_parser("eval", help="quality evaluation of KV cache settings", epilog=EXAMPLES,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ev.add_subparsers(dest="eval_command", required=True, parser_class=type(ev))
    p = _sub(sub, "ppl", "perplexity of a text file through the engine (prompt logprobs)", run_ppl)
    _text_args(p, window=1024)
    p.add_argument("--rolling", action="store_true",
                   help="score every token with lm-eval's loglikelihood_rolling windows (prefixed with the "
                   "tokenizer's BOS, else EOS; compare with lm-eval at max_length = --window + 1)")
    p = _sub(sub, "attn-error", "per-layer attention-output relative error vs the float32 cache", run_attn_error)
    _text_args(p, window=512)
    p = _sub(sub, "agreement", "greedy agreement with the float32 cache on arena-hard chat prompts", run_agreement)
    p.add_argument("--num-prompts", type=int, default=16, help="bundled arena-hard prompts (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="prompt cap (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (default: %(default)s)")
    return ev


def _sub(sub, name: str, help_text: str, func) -> argparse.ArgumentParser:
    from pagedkv.cli_common import add_engine_args

    p = sub.add_parser(name, help=help_text, description=help_text, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object per setting")
    add_engine_args(p)
    for action in p._actions:  # here --kv-cache-dtype takes a list of settings to compare
        if action.dest == "kv_cache_dtype":
            action.choices, action.default = None, DEFAULT_SETTINGS if name != "ppl" else "float32,int8,fp8_e4m3"
            action.help = ("comma-separated dtype[:granularity] settings; " +
                           ("errors are against float32" if name == "attn-error" else "the first is the baseline")
                           + " (default: %(default)s)")
        if action.dest == "kv_cache_scale":
            action.help = "granularity of settings given without one (default: %(default)s)"
    p.set_defaults(func=func)
    return p


def _text_args(p: argparse.ArgumentParser, window: int) -> None:
    p.add_argument("--file", type=Path, required=True, help="UTF-8 text file to score")
    p.add_argument("--num-tokens", type=int, default=8192, help="use the first N tokens (default: %(default)s)")
    p.add_argument("--window", type=int, default=window, help="tokens per window (default: %(default)s)")


def _text_ids(a, tokenizer) -> list[int]:
    if a.num_tokens < 2 or a.window < 2:
        raise ValueError("--num-tokens and --window must be at least 2")
    if not a.file.exists():
        raise FileNotFoundError(f"text file {a.file} does not exist")
    if not a.file.is_file():
        raise ValueError(f"{a.file} is not a regular file")
    text = a.file.read_text(encoding="utf-8")
    return tokenizer(text[: a.num_tokens * 12], add_special_tokens=False).input_ids


def _llm(a, setting, **extra):
    from pagedkv import LLM
    from pagedkv.cli_common import engine_kwargs

    return LLM(**(engine_kwargs(a) | setting.engine_args() | extra))


def run_ppl(a) -> int:
    from pagedkv.eval.ppl import perplexity
    from pagedkv.eval.settings import parse_settings

    settings, results = parse_settings(a.kv_cache_dtype, a.kv_cache_scale), []
    for s in settings:
        llm = _llm(a, s, max_model_len=a.window + 1)
        tok = llm.get_tokenizer()
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        results.append(perplexity(llm, _text_ids(a, tok), a.num_tokens, a.window, a.rolling, prefix))
        del llm
    base = results[0].ppl
    numerics = {"weight_dtype": a.weight_dtype, "activation_dtype": a.activation_dtype}
    if not a.json:
        print(f"weights {a.weight_dtype}, activations {a.activation_dtype}; KV cache settings (compared with the first):")
    for s, r in zip(settings, results):
        if a.json:
            print(json.dumps(r.to_dict() | numerics | {"setting": s.label, "ppl_vs_first": r.ppl / base}))
        else:
            print(f"{s.label:>24}  ppl {r.ppl:9.4f}  ({(r.ppl / base - 1) * 100:+.3f}% vs {settings[0].label})  "
                  f"{r.num_scored_tokens} tokens in {r.num_windows} windows")
    return 0


def run_attn_error(a) -> int:
    from pagedkv.eval.attn_error import attention_errors
    from pagedkv.engine.setup import engine_calibration_ids
    from pagedkv.eval.ppl import windows
    from pagedkv.eval.settings import KVSetting, parse_settings

    settings = parse_settings(a.kv_cache_dtype, a.kv_cache_scale)
    llm = _llm(a, KVSetting("float32"), max_model_len=a.window + 1)
    wins = windows(_text_ids(a, llm.get_tokenizer()), a.num_tokens, a.window)
    cal = engine_calibration_ids(llm.get_tokenizer(), llm.engine.parts.files.config)  # as the engine's
    errors = attention_errors(llm.engine.parts.model, wins, settings, cal)
    for label, per_layer in errors.items():
        mean, worst = sum(per_layer) / len(per_layer), max(per_layer)
        if a.json:
            print(json.dumps({"setting": label, "mean": mean, "max": worst, "max_layer": per_layer.index(worst),
                              "per_layer": per_layer, "num_tokens": sum(map(len, wins))}))
        else:
            print(f"{label:>24}  relative error mean {mean:.2e}  max {worst:.2e} (layer {per_layer.index(worst)})")
    return 0


def run_agreement(a) -> int:
    from pagedkv.bench.workloads import arena_hard_workload
    from pagedkv.eval.agreement import greedy_agreement
    from pagedkv.eval.settings import parse_settings

    if a.num_prompts < 1 or a.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be at least 1")
    settings = parse_settings(a.kv_cache_dtype, a.kv_cache_scale)
    tokenizer = _llm(a, settings[0]).get_tokenizer()
    work = arena_hard_workload(tokenizer, a.num_prompts, a.max_prompt_tokens, a.max_tokens)
    prompts = [list(r.prompt_token_ids) for r in work]
    results = greedy_agreement(lambda s: _llm(a, s), prompts, a.max_tokens, settings, baseline=settings[0])
    for r in results:
        if a.json:
            print(json.dumps(r.to_dict()))
        else:
            print(f"{r.setting:>24}  teacher-forced {r.teacher_forced * 100:6.2f}%  free-running "
                  f"{r.free_running * 100:6.2f}%  ({r.num_tokens} tokens, {r.num_prompts} prompts)")
    return 0
