"""``pagedkv eval ppl | attn-error | agreement | needle``: what a KV setting costs in quality.

Each takes ``--kv-cache-dtype`` as a comma-separated list of settings, ``dtype`` or
``dtype:granularity`` (see :mod:`pagedkv.eval.settings`; ``--kv-cache-scale`` is the
granularity of entries without one). ``ppl`` and ``agreement`` compare with the first
setting; ``attn-error`` always measures against the float32 cache. ``needle`` runs the one
engine its flags describe (:mod:`pagedkv.eval.needle`).
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
  pagedkv eval needle --lengths 2048,4096 --kv-eviction streaming --kv-window-tokens 1020
"""
DEFAULT_SETTINGS = "float32,float16,int8,int8:per-head,int8:per-tensor,fp8_e4m3,fp8_e5m2"



def add_parser(subparsers) -> argparse.ArgumentParser:
    ev = subparsers.add_parser("eval", help="quality evaluation of KV cache settings", epilog=EXAMPLES,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ev.add_subparsers(dest="eval_command", required=True, parser_class=type(ev))
    p = _sub(sub, "ppl", "perplexity of a text file through the engine (prompt logprobs)", run_ppl)
    _text_args(p, window=1024)
    p.add_argument("--by-position", type=int, default=0, metavar="N",
                   help="also print perplexity per N tokens of the text, by position (long-context quality: "
                   "e.g. --window 40960 --by-position 4096 with --kv-eviction streaming)")
    p.add_argument("--rolling", action="store_true",
                   help="score every token with lm-eval's loglikelihood_rolling windows (prefixed with the "
                   "tokenizer's BOS, else EOS; compare with lm-eval at max_length = --window + 1)")
    p = _sub(sub, "attn-error", "per-layer attention-output relative error vs the float32 cache", run_attn_error)
    _text_args(p, window=512)
    p = _sub(sub, "needle", "passkey retrieval: a fact planted at depths of real-text haystacks, asked at the end",
             run_needle)
    p.add_argument("--file", type=Path, default=None, help="haystack text (default: the bundled Monte Cristo "
                   "chapters)")
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens; each needs 8 more "
                   "positions for the answer (default: %(default)s)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, 0 (start) to 1 (end) "
                   "(default: %(default)s)")
    p.add_argument("--num-trials", type=int, default=3, help="passkeys per cell, drawn from --seed "
                   "(default: %(default)s)")
    p.add_argument("--kv-budget-fraction", type=float, default=None, metavar="F",
                   help="with --kv-eviction snapkv|h2o: each request keeps this fraction of its prompt "
                   "(instead of --kv-budget-tokens), e.g. 0.25")
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
        if action.dest == "kv_cache_dtype" and name == "needle":
            continue  # one engine setting, as given
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
    p.add_argument("--file", type=Path, default=None,
                   help="UTF-8 text file to score (default: the bundled chapters 1-8 of The Count of Monte "
                   "Cristo, 43,657 tokens, public domain)")
    p.add_argument("--num-tokens", type=int, default=8192, help="use the first N tokens (default: %(default)s)")
    p.add_argument("--window", type=int, default=window, help="tokens per window (default: %(default)s)")


def _text_ids(a, tokenizer) -> list[int]:
    if a.num_tokens < 2 or a.window < 2:
        raise ValueError("--num-tokens and --window must be at least 2")
    return _read_ids(a.file, tokenizer, a.num_tokens * 12)


def _read_ids(file: Path | None, tokenizer, max_chars: int) -> list[int]:
    """Token ids of the first ``max_chars`` characters of ``file`` (default: the bundled text)."""
    if file is None:
        from pagedkv.data import LONG_TEXT, data_path

        file = data_path(LONG_TEXT)
    if not file.exists():
        raise FileNotFoundError(f"text file {file} does not exist")
    if not file.is_file():
        raise ValueError(f"{file} is not a regular file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return tokenizer(text[:max_chars], add_special_tokens=False).input_ids


def _llm(a, setting, **extra):
    """An engine from the flags, with ``setting``'s KV dtype (None: the flags' own)."""
    from pagedkv import LLM
    from pagedkv.cli_common import engine_kwargs

    return LLM(**(engine_kwargs(a) | (setting.engine_args() if setting is not None else {}) | extra))


def run_ppl(a) -> int:
    from pagedkv.eval.ppl import perplexity
    from pagedkv.eval.settings import parse_settings

    if a.by_position < 0:
        raise ValueError(f"--by-position must be >= 0, got {a.by_position}")
    if a.kv_eviction in ("snapkv", "h2o"):
        raise ValueError(f"--kv-eviction {a.kv_eviction} evicts once a prompt has been scored, so prompt "
                         "log-probs (perplexity) never see it: measure it with pagedkv eval needle")
    settings, results = parse_settings(a.kv_cache_dtype, a.kv_cache_scale), []
    for s in settings:
        llm = _llm_within(a, s, a.window + 1, f"--window {a.window}: the window and the position after it "
                          "(use a smaller --window, or --kv-eviction streaming)")
        tok = llm.get_tokenizer()
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        results.append(perplexity(llm, _text_ids(a, tok), a.num_tokens, a.window, a.rolling, prefix,
                                  bucket=a.by_position))
        del llm
    base = results[0].ppl
    numerics = {"weight_dtype": a.weight_dtype, "activation_dtype": a.activation_dtype, "attention": _attention(a)}
    if not a.json:
        print(f"weights {a.weight_dtype}, activations {a.activation_dtype}, {_attention(a)}; "
              "KV cache settings (compared with the first):")
    for s, r in zip(settings, results):
        if a.json:
            print(json.dumps(r.to_dict() | numerics | {"setting": s.label, "ppl_vs_first": r.ppl / base}))
        else:
            print(f"{s.label:>24}  ppl {r.ppl:9.4f}  ({(r.ppl / base - 1) * 100:+.3f}% vs {settings[0].label})  "
                  f"{r.num_scored_tokens} tokens in {r.num_windows} windows")
            for b in r.by_position:
                print(f"{'':>24}  positions {b.start:>7,}-{b.end - 1:<7,}  ppl {b.ppl:9.4f}  "
                      f"({b.num_scored_tokens} tokens)")
    return 0


def _llm_within(a, setting, positions: int, needs: str, **extra):
    """An engine of ``max_model_len = positions``; if the model has fewer positions, the
    error says what ``needs`` them (the flag to change)."""
    try:
        return _llm(a, setting, max_model_len=positions, **extra)
    except ValueError as e:
        if "exceeds the model's limit" not in str(e):
            raise
        raise ValueError(f"{needs} need {positions} positions, more than the model has ({e})") from None


def _attention(a) -> str:
    """The attention/eviction setting a run measured, in words."""
    if a.kv_eviction == "none":
        return "dense attention"
    if a.kv_eviction == "streaming":
        return (f"streaming eviction ({a.num_sink_tokens if a.num_sink_tokens is not None else 4} sinks + "
                f"{a.kv_window_tokens}-token window, {a.streaming_positions} positions)")
    budget = (f"{a.kv_budget_fraction:g} of each prompt" if getattr(a, "kv_budget_fraction", None) is not None
              else f"{a.kv_budget_tokens} tokens")
    return f"{a.kv_eviction} eviction (budget {budget})"


def run_attn_error(a) -> int:
    from pagedkv.eval.attn_error import attention_errors
    from pagedkv.eval.ppl import windows
    from pagedkv.eval.settings import KVSetting, parse_settings
    from pagedkv.model.load import engine_calibration_ids

    if getattr(a, "tensor_parallel_size", 1) > 1:
        raise ValueError("eval attn-error runs the model's layers itself, in this process: it does not take "
                         "--tensor-parallel-size")
    settings = parse_settings(a.kv_cache_dtype, a.kv_cache_scale)
    llm = _llm(a, KVSetting("float32"), max_model_len=a.window + 1)
    wins = windows(_text_ids(a, llm.get_tokenizer()), a.num_tokens, a.window)
    cal = engine_calibration_ids(llm.get_tokenizer(), llm.engine.model_files.config)  # as the engine's
    errors = attention_errors(llm.engine.model, wins, settings, cal)
    for label, per_layer in errors.items():
        mean, worst = sum(per_layer) / len(per_layer), max(per_layer)
        if a.json:
            print(json.dumps({"setting": label, "mean": mean, "max": worst, "max_layer": per_layer.index(worst),
                              "per_layer": per_layer, "num_tokens": sum(map(len, wins))}))
        else:
            print(f"{label:>24}  relative error mean {mean:.2e}  max {worst:.2e} (layer {per_layer.index(worst)})")
    return 0


def _numbers(text: str, flag: str, kind: type) -> list:
    """Comma-separated numbers of ``kind``. Raises ValueError naming ``flag`` and the bad item."""
    out = []
    for x in text.split(","):
        try:
            out.append(kind(x))
        except ValueError:
            raise ValueError(f"{flag} takes comma-separated {kind.__name__}s, got {x.strip()!r} "
                             f"in {text!r}") from None
    if len(set(out)) < len(out):
        raise ValueError(f"{flag} repeats a value: {text}")
    return out


def run_needle(a) -> int:
    from pagedkv.eval.needle import ANSWER_TOKENS, check_lengths, needle_eval

    lengths, depths = _numbers(a.lengths, "--lengths", int), _numbers(a.depths, "--depths", float)
    if min(lengths) < 2:
        raise ValueError(f"--lengths are prompt lengths in tokens (a passkey prompt needs about 75), got {a.lengths}")
    if a.num_trials < 1:
        raise ValueError(f"--num-trials must be at least 1, got {a.num_trials}")
    if a.max_model_len is not None and max(lengths) + ANSWER_TOKENS > a.max_model_len:
        raise ValueError(f"--lengths: the longest prompt ({max(lengths)}) and its {ANSWER_TOKENS}-token answer "
                         f"exceed --max-model-len {a.max_model_len}")
    if a.file is not None and not a.file.is_file():
        raise FileNotFoundError(f"--file {a.file} does not exist or is not a file")
    if not all(0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths are fractions of the haystack from 0 (start) to 1 (end), got {a.depths}")
    frac = a.kv_budget_fraction
    if frac is not None and a.kv_eviction not in ("snapkv", "h2o"):
        raise ValueError("--kv-budget-fraction sets each request's budget under --kv-eviction snapkv or h2o")
    if frac is not None and not 0 < frac <= 1:
        raise ValueError(f"--kv-budget-fraction must be in (0, 1], got {frac}")
    if frac is not None and a.kv_budget_tokens is None:
        a.kv_budget_tokens = max(lengths)  # the engine's default; every request sets its own
    llm = _llm_within(a, None, a.max_model_len or max(lengths) + ANSWER_TOKENS,
                      f"--lengths: the longest prompt and its {ANSWER_TOKENS}-token answer", enable_prefix_caching=True)
    if frac is not None:
        c = llm.engine.config
        if round(frac * min(lengths)) < c.num_sink_tokens + c.kv_window_tokens:
            raise ValueError(f"--kv-budget-fraction {frac} of {min(lengths)} tokens is under the sinks + window "
                             f"({c.num_sink_tokens} + {c.kv_window_tokens} tokens)")
    text = _read_ids(a.file, llm.get_tokenizer(), max(lengths) * 12)
    check_lengths(llm.get_tokenizer(), text, lengths)

    if not a.json:
        print(f"passkey retrieval, {_attention(a)}:", flush=True)

    def show(c):
        if a.json:
            print(json.dumps(c.to_dict() | {"attention": _attention(a)}), flush=True)
        else:
            print(f"length {c.length:>7,}  depth {c.depth:4.0%}  {c.correct}/{c.trials} correct", flush=True)

    cells = needle_eval(llm, text, lengths, depths, a.num_trials, ANSWER_TOKENS, a.seed, show, frac)
    total = sum(c.correct for c in cells) / sum(c.trials for c in cells)
    if a.json:
        print(json.dumps({"accuracy": total, "trials": sum(c.trials for c in cells)}))
    else:
        print(f"accuracy {total:.1%} over {sum(c.trials for c in cells)} trials")
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
