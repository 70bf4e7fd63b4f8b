"""``pagedkv bench``: benchmarks against the baselines and the machine's roofline.

Register with ``add_parser(subparsers)``; the ``func`` it sets returns an exit code.
Results print as a table (medians over ``--repeats``), ratios and goals; ``--output``
writes the JSON document (schema in :mod:`pagedkv.bench.report`), ``--plot`` a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

BENCH_EXAMPLES = """examples:
  # offline throughput: pagedkv vs the contiguous allocator vs HF static batches
  pagedkv bench throughput --num-prompts 64 --max-prompt-tokens 512 --max-tokens 128 \\
      --systems pagedkv,contiguous,hf,hf-cb --repeats 3 --output out/throughput.json --plot out/throughput.png
  # capacity at a fixed KV budget on the hh-rlhf length distribution: waste, running at once
  pagedkv bench capacity --kv-cache-memory 128MiB --num-prompts 64 --output out/capacity.json
  # online serving: Poisson arrivals at 2 requests/s
  pagedkv bench online --request-rate 2 --num-prompts 32 --max-tokens 64
  # single-stream decode against the weight-read bound
  pagedkv bench latency --num-prompts 3 --max-tokens 64
  # prefix caching on vs off (shared 1,024-token system prompt) + multi-turn replay
  pagedkv bench prefix --num-prompts 32 --output out/prefix.json
  # seconds-long smoke run
  pagedkv bench throughput --num-prompts 4 --max-prompt-tokens 64 --max-tokens 8 --systems pagedkv,hf

systems: pagedkv, contiguous (same engine, --kv-allocator contiguous), hf (transformers
generate, static padded batches), hf-cb (transformers continuous batching), llama-cpp
(llama.cpp on the GGUF, batched as llama-batched-bench does, when llama-cpp-python is
installed: pip install ../shared/wheels/llama_cpp_python-*.whl). Datasets (bundled, see
pagedkv/data/README.md): arena-hard, hh-rlhf, shared-prefix.
"""

DESCRIPTION = ("Benchmark pagedkv on bundled real workloads against its baselines (contiguous allocator, "
               "HF transformers, llama.cpp) and this machine's roofline, measured in the same run. "
               "Prints medians over --repeats, ratios and the goals (see BENCHMARKS.md); --output writes JSON, "
               "--plot a PNG.")

DEFAULTS = {  # per command: dataset, prompts, prompt cap, max tokens, systems
    "throughput": ("arena-hard", 64, 512, 128, "pagedkv,contiguous,hf"),
    "online": ("arena-hard", 32, 512, 64, "pagedkv,contiguous"),
    "capacity": ("hh-rlhf", 64, 512, 256, "pagedkv,contiguous"),
    "latency": ("arena-hard", 3, 512, 64, "pagedkv,hf"),
    "prefix": ("shared-prefix", 32, 2048, 16, "pagedkv"),
}
HELP = {
    "throughput": "offline throughput (all requests at once) against the baselines and the roofline",
    "online": "Poisson arrivals at --request-rate; TTFT/TPOT/ITL percentiles",
    "capacity": "paged vs contiguous allocator at a fixed KV budget: waste, requests running at once",
    "latency": "single-stream decode against the weight-read bound",
    "prefix": "prefix caching on vs off on a shared system prompt, and a multi-turn replay hit rate",
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` (with its commands) on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("bench", help="benchmarks against baselines and the roofline",
                              description=DESCRIPTION, epilog=BENCH_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="COMMAND", parser_class=type(p))
    for name, help_text in HELP.items():
        c = sub.add_parser(name, help=help_text, description=help_text, epilog=BENCH_EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_common(c, name)
        c.set_defaults(func=run_bench)
    p.set_defaults(func=run_bench)
    return p


def _add_common(c: argparse.ArgumentParser, name: str) -> None:
    from pagedkv.bench.workloads import DATASETS
    from pagedkv.cli_common import add_engine_args

    dataset, prompts, cap, max_tokens, systems = DEFAULTS[name]
    g = c.add_argument_group("workload")
    g.add_argument("--dataset", default=dataset, choices=DATASETS, help="bundled workload (default: %(default)s)")
    g.add_argument("--num-prompts", type=int, default=prompts, help="requests (default: %(default)s)")
    g.add_argument("--max-prompt-tokens", type=int, default=cap,
                   help="cap on chat-templated prompt tokens (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="output tokens per request; hh-rlhf: the cap on reply lengths (default: %(default)s)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (default: ignore it, so every system does the same work)")
    g.add_argument("--request-rate", type=float, default=1.0 if name == "online" else math.inf,
                   help="Poisson arrivals, requests/s (default: %(default)s = all at once)")
    g.add_argument("--workload-seed", type=int, default=0, help="draws of conversations and arrivals")
    r = c.add_argument_group("run")
    r.add_argument("--systems", default=systems, help="comma-separated systems (default: %(default)s)")
    r.add_argument("--repeats", type=int, default=1, help="runs per system; medians are reported")
    r.add_argument("--hf-batch-size", type=int, default=16, help="HF static batch size (default: %(default)s)")
    r.add_argument("--output", type=Path,
                   help="write the JSON result here (also after every run, marked incomplete, until the end)")
    r.add_argument("--plot", type=Path, help="write a PNG plot here")
    r.add_argument("--json", action="store_true", help="print the JSON result to stdout instead of tables")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars on stderr")
    r.add_argument("--quick-measure", action="store_true",
                   help="measure bandwidth and matmul rate on small buffers (seconds faster, less exact)")
    if name == "prefix":
        g.add_argument("--prefix-tokens", type=int, default=1024,
                       help="shared system prompt tokens (default: %(default)s)")
        g.add_argument("--question-tokens", type=int, default=64, help="tokens of each question (default: %(default)s)")
        r.add_argument("--replay-conversations", type=int, default=16, help="hh-rlhf conversations to replay; 0 = skip")
        r.add_argument("--replay-turns", type=int, default=4, help="most turns per conversation")
        r.add_argument("--replay-max-tokens", type=int, default=32, help="reply tokens per turn")
    add_engine_args(c, {"kv_cache_memory": "128MiB"} if name == "capacity" else None)


def settings_from_args(a: argparse.Namespace):
    """Validated :class:`Settings`. Raises ValueError on a bad value (before any loading)."""
    from pagedkv.bench.suite import SYSTEMS, Settings
    from pagedkv.cli_common import engine_kwargs
    from pagedkv.config.engine import EngineConfig

    systems = tuple(s.strip() for s in a.systems.split(",") if s.strip())
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise ValueError(f"unknown system(s) {', '.join(bad) or '(none)'}; choose from {', '.join(SYSTEMS)}")
    for flag in ("num_prompts", "max_prompt_tokens", "max_tokens", "repeats", "hf_batch_size"):
        if getattr(a, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if not a.request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {a.request_rate}")
    kw = engine_kwargs(a)
    EngineConfig(**kw)   # validates the engine flags now
    return Settings(engine=kw, systems=systems, dataset=a.dataset, num_prompts=a.num_prompts,
                    max_prompt_tokens=a.max_prompt_tokens, max_tokens=a.max_tokens, ignore_eos=a.ignore_eos,
                    request_rate=a.request_rate, repeats=a.repeats, hf_batch_size=a.hf_batch_size,
                    seed=a.workload_seed, progress=a.progress, quick_machine=a.quick_measure, checkpoint=a.output)


def run_bench(a: argparse.Namespace) -> int:
    from pagedkv.bench import report

    if getattr(a, "bench_command", None) is None:
        raise ValueError("choose a bench command: " + ", ".join(HELP))
    settings = settings_from_args(a)
    result = _dispatch(a, settings)
    if a.output:
        report.write_json(result, a.output)
    if a.plot:
        report.plot(result, a.plot)
    if a.json:
        print(json.dumps(result, default=str))
    else:
        print(text_report(result))
    return 0


def _dispatch(a: argparse.Namespace, settings) -> dict:
    from pagedkv.bench import prefix, suite

    if a.bench_command == "prefix":
        return prefix.prefix(settings, a.replay_conversations, a.replay_turns, a.replay_max_tokens,
                             a.prefix_tokens, a.question_tokens)
    return getattr(suite, a.bench_command)(settings)


def text_report(result: dict) -> str:
    from pagedkv.bench import report

    out = [f"pagedkv bench {result['command']}: {result['workload'].get('num_requests')} requests "
           f"({result['workload'].get('dataset')}), medians over {result['settings'].get('repeats')} repeat(s); "
           f"pagedkv weights {result.get('model', {}).get('weight_dtype', 'auto')}, activations "
           f"{result.get('model', {}).get('activation_dtype', 'float32')}"
           + (" (HF baselines: float32)" if any(str(x).startswith("hf") for x in result['settings'].get('systems', ()))
              else ""),
           f"machine: read {result['machine'].get('read_bandwidth', 0) / 1e9:.1f} GB/s, "
           f"fp32 matmul {result['machine'].get('fp32_flops', 0) / 1e9:.0f} GFLOP/s, int8 GEMM "
           f"{result['machine'].get('int8_ops', 0) / 1e9:.0f} GOP/s (measured in this run); "
           f"load average {result['machine'].get('loadavg_1min_start', 0):.1f} -> "
           f"{result['machine'].get('loadavg_1min_end', 0):.1f} on {result['machine'].get('cpus')} CPUs", "",
           report.markdown_table(result)]
    if result.get("best") and (result["settings"].get("repeats") or 1) > 1:
        key = next(iter(result["best"].values())).get("best_by", "")
        out += ["", f"each system's best run of {result['settings'].get('repeats')} (by {key}):", "",
                report.markdown_table(result, "best")]
    for system, reason in result["skipped"].items():
        out.append(f"skipped {system}: {reason}")
    if result["ratios"]:
        out += [""] + [f"{k}: median {v['median']:.3g} (per repeat: {', '.join(f'{x:.3g}' for x in v['per_repeat'])}"
                       + (f"; best of each {v['best_of_each']:.3g})" if v.get("best_of_each") else ")")
                       for k, v in result["ratios"].items() if v["median"] is not None]
    if result["goals"]:
        out += ["", report.goals_text(result)]
    if "replay" in result:
        r = result["replay"]
        out += ["", f"multi-turn replay: {r['requests']} requests, hit rate {100 * r['hit_rate_all_turns']:.1f}% "
                    f"(turns >= 2: {100 * r['hit_rate_turns_2plus']:.1f}% of a possible "
                    f"{100 * r['possible_hit_rate_turns_2plus']:.1f}%)"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedkv.bench ...`` until ``pagedkv bench`` is wired into the main CLI."""
    from pagedkv.cli_common import OneLineErrorParser

    parser = OneLineErrorParser(prog="pagedkv")
    add_parser(parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
