"""``pagedkv eval ppl``: perplexity of a text file for one or more KV cache dtypes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXAMPLES = """examples:
  pagedkv eval ppl --file ../shared/data/wikitext-2-raw/wiki.test.raw --num-tokens 8192 --window 1024 \\
      --kv-cache-dtype float32,float16,bfloat16
  pagedkv eval ppl --file my.txt --json
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagedkv.cli import add_engine_args

    ev = subparsers.add_parser("eval", help="quality evaluation of KV cache settings")
    sub = ev.add_subparsers(dest="eval_command", required=True, parser_class=type(ev))
    p = sub.add_parser("ppl", help="perplexity of a text file through the engine", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", type=Path, required=True, help="UTF-8 text file to score")
    p.add_argument("--num-tokens", type=int, default=8192, help="score the first N tokens (default: %(default)s)")
    p.add_argument("--window", type=int, default=1024, help="tokens per window (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object per dtype")
    add_engine_args(p)
    for action in p._actions:  # here --kv-cache-dtype takes a comma-separated list to compare
        if action.dest == "kv_cache_dtype":
            action.choices, action.help = None, "comma-separated KV dtypes; the first is the baseline"
    p.set_defaults(func=run_ppl)
    return p


def run_ppl(a) -> int:
    from pagedkv import LLM
    from pagedkv.cli import engine_kwargs
    from pagedkv.eval.ppl import perplexity

    if a.num_tokens < 2 or a.window < 2:
        raise ValueError("--num-tokens and --window must be at least 2")
    if not a.file.is_file():
        raise FileNotFoundError(f"text file {a.file} does not exist")
    text = a.file.read_text(encoding="utf-8")
    results = []
    for dtype in a.kv_cache_dtype.split(","):
        llm = LLM(**(engine_kwargs(a) | {"kv_cache_dtype": dtype, "max_model_len": a.window + 1}))
        ids = llm.get_tokenizer()(text[: a.num_tokens * 12], add_special_tokens=False).input_ids
        results.append(perplexity(llm, ids, a.num_tokens, a.window))
        del llm
    base = results[0].ppl
    for r in results:
        if a.json:
            print(json.dumps(r.to_dict() | {"ppl_vs_first": r.ppl / base}))
        else:
            print(f"{r.kv_cache_dtype:>10}  ppl {r.ppl:9.4f}  ({(r.ppl / base - 1) * 100:+.3f}% vs "
                  f"{results[0].kv_cache_dtype})  {r.num_scored_tokens} tokens in {r.num_windows} windows",
                  file=sys.stdout)
    return 0
