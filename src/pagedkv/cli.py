"""The ``pagedkv`` command: ``generate``, ``plan`` and friends.

Every command exits 0 on success and 2 with a one-line ``error: ...`` on bad input. The
engine flags and the parser class come from :mod:`pagedkv.cli_common`, which the
subcommand modules (bench, eval, serve) import too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pagedkv.cli_common import OneLineErrorParser as _Parser
from pagedkv.cli_common import add_engine_args, engine_kwargs

GENERATE_EXAMPLES = """examples:
  pagedkv generate "What is the capital of France?"
  pagedkv generate --json --temperature 0 --max-tokens 32 "What is the capital of France?"
  pagedkv generate --no-chat --max-tokens 40 "Once upon a time"
  pagedkv generate --prompts-file prompts.jsonl --kv-cache-memory 256MiB --json > out.jsonl
"""


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens whose probability reaches P "
                        "(default: 1.0, off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default: 0, off)")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, action="append", default=[], metavar="ID",
                   help="token id that ends generation (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(a: argparse.Namespace):
    from pagedkv.core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          seed=a.sampling_seed, stop=a.stop, stop_token_ids=a.stop_token_ids,
                          ignore_eos=a.ignore_eos)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedkv", description="A KV-cache engine for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate text for prompts", epilog=GENERATE_EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompts", nargs="*", help="prompt strings")
    gen.add_argument("--prompts-file", type=Path,
                     help="prompts to run after any given as arguments: plain text, one a line; or, "
                     "for .jsonl/.json names, one JSON string or {\"prompt\": ...} object a line (.json: or one "
                     "array of them)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the model's chat template (default: on when the model has one)")
    gen.add_argument("--json", action="store_true", help="one JSON object per request, then a stats object")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=_run_generate)
    from pagedkv.bench.cli import add_parser as add_bench
    from pagedkv.eval.cli import add_parser as add_eval
    from pagedkv.info_cmd import add_parser as add_info
    from pagedkv.planner.cli import add_parser as add_plan
    from pagedkv.server.cli import add_parser as add_serve
    from pagedkv.server.proxy import add_parser as add_proxy
    from pagedkv.sim.cli import add_parser as add_simulate

    add_plan(sub)
    add_serve(sub)
    add_proxy(sub)
    add_bench(sub)
    add_simulate(sub)
    add_eval(sub)
    add_info(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, TypeError, OverflowError, MemoryError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a tensor-parallel rank died or timed out: its reason in one line
        from pagedkv.distributed.executor import TPGroupError

        if not isinstance(e, TPGroupError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `pagedkv generate ... | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def _run_generate(a: argparse.Namespace) -> int:
    from pagedkv.generate_cmd import run_generate

    return run_generate(a, engine_kwargs(a), sampling_params(a))


if __name__ == "__main__":
    sys.exit(main())
