"""``pagedkv plan``: the planner's command line.

:func:`add_parser` registers the subcommand on an argparse ``subparsers`` object
and sets ``func=run_plan``; :func:`run_plan` returns the exit code (0, or 2 with
one ``error: ...`` line on stderr for bad input). Numbers are parsed here rather
than by argparse so that every input error is that one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagedkv.config.engine import DEFAULT_MODEL

EXAMPLES = """\
examples:
  pagedkv plan --model llama-3-70b --gpu a100-80gb-sxm4 --kv-cache-dtype fp16 \\
      --weight-dtype fp16 --seq-len 4096 --batch 32 --tp 2
  pagedkv plan --model llama-3-70b --kv-heads 64 --kv-cache-dtype fp16   # the MHA variant
  pagedkv plan --model deepseek-v3 --gpu h200 --tp 8 --seq-len 32768 --batch 16
  pagedkv plan --model ./my-model/config.json --gpu l40s --kv-cache-dtype int8 --json
  pagedkv plan --model smollm2-135m-instruct --kv-cache-memory 256MiB --block-size 16 --json
  pagedkv plan --model llama-3-8b --gpu cpu            # measures this machine once, then caches
  pagedkv plan --model llama-3-70b --gpu h100-sxm --tp 4 --plot plan.png
  pagedkv plan --sweep --model llama-3-8b,llama-3-70b --gpu a100-80gb-sxm4,h100-sxm,h200
  pagedkv plan --list-models
  pagedkv plan --list-gpus

Sizes print in bytes with GB (1e9) and GiB (2^30) beside them. Times are lower
bounds (roofline): a real engine is slower.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plan`` on ``subparsers``; returns the new parser."""
    p = subparsers.add_parser(
        "plan", help="KV-cache memory and bandwidth arithmetic for a model on a GPU",
        description="Bytes per token of the KV cache, what fits next to the weights, and lower bounds "
                    "of decode and prefill steps: the same arithmetic the engine sizes its cache with.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"bundled name (see --list-models), a config.json or its folder; "
                                   f"with --sweep a comma list (default: {DEFAULT_MODEL}; sweep: all)")
    p.add_argument("--gpu", help="catalog name (see --list-gpus) or 'cpu' to measure this machine; "
                                 "with --sweep a comma list (default: none, memory only; sweep: all)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto|float32|float16|bfloat16|fp8_e4m3|fp8_e5m2|int8|int4 (also fp16, bf16, fp8); "
                        "auto = the engine's compute dtype (default: auto)")
    p.add_argument("--kv-cache-scale", "--kv-scale", dest="kv_scale", default="per-token-head",
                   help="scales of quantized KV: per-tensor|per-head|per-token-head|per-channel "
                        "(default: per-token-head)")
    p.add_argument("--weight-dtype", default="auto",
                   help="the --kv-cache-dtype names (int4: 4 bits, scales not counted), or q4_1 / q8_0 "
                        "(GGML blocks, scales counted: 0.625 / 1.0625 bytes per weight; the CPU engine's "
                        "--weight-dtype auto on the default Q4_1 GGUF keeps its layers in q4_1 and its LM "
                        "head in q8_0, so it reads between the two) (default: auto)")
    p.add_argument("--seq-len", default="4096", help="tokens per request, prompt + output (default: 4096)")
    p.add_argument("--batch", default="1", help="concurrent requests (default: 1)")
    p.add_argument("--tp", default="1", help="tensor-parallel devices (default: 1)")
    p.add_argument("--gpu-memory-utilization", default="0.9",
                   help="fraction of device memory for weights + KV cache (default: 0.9)")
    p.add_argument("--activation-peak", help="bytes per device beside the weights that the GPU engine's "
                                             "profiling step takes (activation peak + memory torch does not "
                                             "manage; the engine logs both), e.g. 1.2GiB: num_blocks is then the "
                                             "GPU engine's")
    p.add_argument("--kv-heads", help="override the KV head count: the MHA/GQA/MQA variant")
    p.add_argument("--block-size", default="16", help="token slots per KV page (default: 16)")
    p.add_argument("--kv-cache-memory", help="KV budget per device, e.g. 256MiB or 20GB (replaces "
                                             "memory left after weights); num_blocks is then the engine's")
    p.add_argument("--kv-offload-memory", help="the engine's CPU KV tier, e.g. 2GiB: its blocks and "
                                               "per-block load time")
    p.add_argument("--kv-offload-disk-size", help="the engine's disk KV tier, e.g. 20GiB (NVMe read rate "
                                                  "from the catalog)")
    p.add_argument("--speculative-config", help="the engine's, as JSON; with "
                   "'{\"method\": \"draft_model\", \"model\": NAME, ...}' the draft's weights and KV are counted")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write cache-vs-context and step-vs-batch plots")
    p.add_argument("--plot-batches", help="batch sizes for the memory plot, e.g. 1,8,32 (default: 1,8,32,128)")
    p.add_argument("--sweep", action="store_true", help="table over models x GPUs")
    p.add_argument("--list-models", action="store_true", help="list bundled models and exit")
    p.add_argument("--list-gpus", action="store_true", help="list the GPU catalog and exit")
    p.set_defaults(func=run_plan)
    return p


def _int(text, flag: str, minimum: int = 1) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{flag} must be an integer, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")
    return value


def _float(text, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} must be a number, got {text!r}") from None


def _fraction(text, flag: str) -> float:
    value = _float(text, flag)
    if not 0 < value <= 1:
        raise ValueError(f"{flag} must be in (0, 1], got {text}")
    return value


def _plan_kwargs(args) -> dict:
    return dict(kv_cache_dtype=args.kv_cache_dtype, weight_dtype=args.weight_dtype,
                seq_len=_int(args.seq_len, "--seq-len"), batch=_int(args.batch, "--batch"),
                tp=_int(args.tp, "--tp"), block_size=_int(args.block_size, "--block-size"),
                gpu_memory_utilization=_fraction(args.gpu_memory_utilization, "--gpu-memory-utilization"),
                kv_heads=None if args.kv_heads is None else _int(args.kv_heads, "--kv-heads"),
                kv_cache_memory=args.kv_cache_memory, kv_scale_granularity=args.kv_scale,
                kv_offload_memory=args.kv_offload_memory, kv_offload_disk_size=args.kv_offload_disk_size,
                speculative_config=args.speculative_config, activation_peak=args.activation_peak)


def _split(text: str | None) -> list[str] | None:
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def _run_sweep(args, kw: dict) -> None:
    from pagedkv.planner.sweep import render_sweep, run_sweep, sweep_dicts
    tp = kw.pop("tp")
    cells = run_sweep(_split(args.model), _split(args.gpu), tp, **kw)
    print(json.dumps(sweep_dicts(cells), indent=2) if args.json else render_sweep(cells, kw["seq_len"], kw["batch"]))


def _run_single(args, kw: dict) -> None:
    from pagedkv.planner.plan import plan
    from pagedkv.planner.report import render
    r = plan(model=args.model or DEFAULT_MODEL, gpu=args.gpu, **kw)
    if args.plot:
        from pagedkv.planner.plots import plot_plan
        batches = [_int(b, "--plot-batches") for b in _split(args.plot_batches)] if args.plot_batches else None
        plot_plan(r, args.plot, batches)
    print(json.dumps(r.to_dict(), indent=2) if args.json else render(r))
    if args.plot and not args.json:
        print(f"\nplot written to {args.plot}")


def run_plan(args) -> int:
    """Run ``pagedkv plan`` for parsed ``args``; returns the exit code."""
    from pagedkv.planner.listing import list_gpus, list_models
    try:
        if args.list_models:
            print(list_models(args.json))
        elif args.list_gpus:
            print(list_gpus(args.json))
        elif args.sweep:
            _run_sweep(args, _plan_kwargs(args))
        else:
            _run_single(args, _plan_kwargs(args))
    except BrokenPipeError:  # `pagedkv plan ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
