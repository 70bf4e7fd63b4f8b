"""``pagedkv simulate``: the engine's scheduler on a cost-model clock, from the command line.

Every engine flag is accepted (the same generated group as ``pagedkv serve``);
``--kv-cache-memory`` defaults to what the device has left after the weights (on
``cpu``: the engine's own default), ``--weight-dtype`` takes the planner's names too
(bf16, fp8, ...). Exit code 0, or 2 with one ``error: ...`` line for bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

from pagedkv.cli_common import add_engine_args, engine_kwargs

EXAMPLES = """examples:
  # the PagedAttention-scale question: a 70B model on 4 A100s at 2 requests/s
  pagedkv simulate --model llama-3-70b --gpu a100-80gb-sxm4 --tp 4 --workload sharegpt-like \\
      --num-prompts 1000 --request-rate 2 --plot kv.png
  # offline: everything at once
  pagedkv simulate --model llama-3-8b --gpu h100-sxm --workload arena-hard --num-prompts 500
  # the highest rate whose mean normalized latency stays under 0.2 s/token
  pagedkv simulate --model opt-13b --gpu a100-40gb --workload sharegpt-like --num-prompts 1000 \\
      --sweep --target normalized_latency=0.2
  # this CPU: fit the cost model to the real engine once, then simulate it
  pagedkv simulate --calibrate
  pagedkv simulate --gpu cpu --workload arena-hard --num-prompts 32 --request-rate 1
  # does splitting prefill and decode pay? 2 prefill + 1 decode instances vs 3 colocated
  pagedkv simulate --model llama-3-70b --gpu h100-sxm --tp 4 --workload random --random-input-len 2048 \\
      --num-prompts 600 --request-rate 8 --disagg 2P1D
  # measured factors instead of the roofline: a fit to torch decoder steps on a real H200
  pagedkv simulate --model llama-3-8b --gpu h200 --efficiency h200/llama-3-8b --workload arena-hard
  # a trace: one {"arrival": s, "prompt_len": n, "output_len": m} per line
  pagedkv simulate --model llama-3-8b --gpu l40s --trace requests.jsonl --json
  # KV tiers: a CPU tier and a disk tier behind it (the simulated disk starts empty;
  # --kv-offload-dir only switches it on: the directory is neither read nor written)
  pagedkv simulate --model llama-3-8b --gpu l4 --workload shared-prefix --kv-cache-memory 1GiB \\
      --kv-offload-memory 4GiB --kv-offload-dir /unused --kv-offload-disk-size 100GiB
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagedkv.bench.workloads import DATASETS
    from pagedkv.sim.sweep import TARGETS
    from pagedkv.sim.workloads import SYNTHETIC

    p = subparsers.add_parser(
        "simulate", help="simulate serving a workload on GPUs we do not have (the engine's scheduler, cost clock)",
        description="Run the engine's own scheduler and KV cache manager on a roofline cost clock: throughput, "
                    "TTFT/TPOT/ITL, preemptions and KV use for any model and accelerator in the planner's catalog.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("simulation")
    s.add_argument("--gpu", default="cpu", help="catalog GPU (pagedkv plan --list-gpus) or cpu (default: cpu)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (default: 1)")
    s.add_argument("--workload", default=None, choices=DATASETS + SYNTHETIC,
                   help="requests: a bundled dataset or a synthetic length distribution (default: arena-hard)")
    s.add_argument("--trace", help="a JSONL trace instead of --workload (arrival, prompt_len, output_len)")
    s.add_argument("--num-prompts", type=int, default=None, help="requests (default: 100)")
    s.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals per second, or inf: all at once (default: inf; not with --trace or --sweep)")
    s.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="arena-hard and hh-rlhf prompts cut to this (default: 512)")
    s.add_argument("--max-tokens", type=int, default=128,
                   help="dataset output tokens (hh-rlhf: at most this, the reply's length) (default: 128)")
    s.add_argument("--random-input-len", type=int, default=256, help="random workload prompt length (default: 256)")
    s.add_argument("--random-output-len", type=int, default=128, help="random workload output length (default: 128)")
    s.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random lengths drawn from len x [1 - r, 1 + r] (default: 0)")
    s.add_argument("--workload-seed", type=int, default=0,
                   help="seed of lengths, arrivals and accepted drafts (default: 0)")
    s.add_argument("--spec-acceptance-rate", type=float, default=None,
                   help="with --speculative-config: the share of drafts the target accepts (accepted / drafted, "
                        "as pagedkv bench reports it); a draft model is a planner model name")
    s.add_argument("--sweep", action="store_true",
                   help="find the highest Poisson request rate meeting --target for these --num-prompts requests")
    s.add_argument("--target", default="normalized_latency=0.2",
                   help=f"METRIC=SECONDS for --sweep; metrics: {', '.join(TARGETS)} (default: normalized_latency=0.2)")
    s.add_argument("--disagg", metavar="XPYD", help="disaggregated prefill/decode, e.g. 2P1D: X prefill and Y decode "
                   "instances of --tp devices each, beside X+Y colocated instances on the same requests")
    s.add_argument("--kv-link-gbps", type=float, default=400.0,
                   help="with --disagg: KV link per device, Gbit/s (default: 400, one ConnectX-7 port per GPU)")
    s.add_argument("--ttft-slo", type=float, default=1.0, help="with --disagg: TTFT target, seconds (default: 1)")
    s.add_argument("--tpot-slo", type=float, default=0.05, help="with --disagg: TPOT target, seconds (default: 0.05)")
    s.add_argument("--efficiency", metavar="NAME|FILE",
                   help="cost-model factors: roofline, a fit measured on a GPU (GPU/MODEL, e.g. h200/llama-3-8b; "
                        "an unknown name lists them) or a JSON file of them (default: this CPU's calibration on "
                        "cpu, else roofline)")
    s.add_argument("--calibrate", action="store_true",
                   help="profile the real engine on this CPU (the engine flags apply), fit the cost model, cache it")
    s.add_argument("--json", action="store_true", help="print the result as JSON (without the timelines)")
    s.add_argument("--output", metavar="FILE.json", help="write the whole result, timelines included")
    s.add_argument("--plot", metavar="FILE.png", help="plot KV blocks and queue length over time")
    add_engine_args(p)
    for a in p._actions:  # the planner's weight names are accepted too; no engine default budget
        if a.dest == "weight_dtype":
            a.choices = None
            a.help = "auto, an engine weight dtype, or a planner name (bf16, fp8, int4, ...) (default: auto)"
        if a.dest == "model":
            a.help = ("a planner model name (pagedkv plan --list-models) or a Hugging Face config.json or its folder "
                      "(default: smollm2-135m-instruct)")
        if a.dest == "kv_cache_memory":
            a.help = ("KV cache budget per device, e.g. 20GB or 512MiB (default: device memory x "
                      "--gpu-memory-utilization - weights / tp; on cpu the engine's 4GiB)")
    p.set_defaults(func=run_simulate, kv_cache_memory=None)
    return p


def _engine_flags(a) -> tuple[dict, str]:
    """The engine flags (``--weight-dtype`` apart: it takes the planner's names too) and it."""
    kw = engine_kwargs(a)
    kw.pop("kv_cache_memory")
    tp = kw.pop("tensor_parallel_size", 1)  # vLLM's name for --tp
    if tp is None or tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tp}")
    if tp != 1:
        if a.tp not in (1, tp):
            raise ValueError(f"--tp {a.tp} and --tensor-parallel-size {tp} disagree: give one")
        a.tp = tp
    return kw, kw.pop("weight_dtype")


def calibration_warnings(r: dict) -> list[str]:
    """What makes a calibration ``r`` suspect: a factor at its cap, or a poor fit (the
    machine was busy, or its speed drifted during the profile)."""
    from pagedkv.sim.fit import MAX_EFFICIENCY

    e, out = r["efficiency"], []
    capped = [k for k in ("memory", "compute", "kv_read", "attention") if e.get(k) == MAX_EFFICIENCY]
    if capped:
        out.append(f"{', '.join(capped)} at the {MAX_EFFICIENCY} cap: the ceilings measured at the start "
                   "were low or the machine sped up during the profile; calibrate again on a quiet machine")
    if r["fit"]["median_abs_rel_error"] > 0.15:
        out.append(f"median step error {100 * r['fit']['median_abs_rel_error']:.0f}% (quiet runs here: ~10%): "
                   "something else was running, or the machine's speed drifted")
    return out


def run_simulate(a) -> int:
    with warnings.catch_warnings():  # a warning is one line, as an error is
        warnings.showwarning = lambda message, *_a, **_k: print(f"warning: {message}", file=sys.stderr)
        try:
            return _run(a)
        except BrokenPipeError:  # `... | head`: pagedkv.cli.main ends quietly
            raise
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2


def _run(a) -> int:
    from pagedkv.config.engine import EngineConfig

    flags, weight = _engine_flags(a)
    if a.trace is not None and (a.workload is not None or a.num_prompts is not None):
        raise ValueError("--trace replaces --workload and --num-prompts: give one or the other")
    a.workload = a.workload or "arena-hard"
    a.num_prompts = 100 if a.num_prompts is None else a.num_prompts
    if a.calibrate:
        from pagedkv.sim.calibrate import calibrate

        if a.efficiency is not None:
            raise ValueError("not with --calibrate: --efficiency (calibrating fits the factors)")
        kw = flags | {"weight_dtype": weight} | ({"kv_cache_memory": a.kv_cache_memory} if a.kv_cache_memory else {})
        r = calibrate(EngineConfig(**kw), progress=True)
        for w in calibration_warnings(r):
            print(f"warning: {w}", file=sys.stderr)
        print(dumps(r, indent=2) if a.json else f"{r['efficiency']['source']}\n"
              f"memory x{r['efficiency']['memory']:.3f}, compute x{r['efficiency']['compute']:.3f}, "
              f"+{1e3 * r['efficiency']['step_overhead_s']:.2f} ms/step, "
              f"+{1e3 * r['efficiency']['request_overhead_s']:.3f} ms/request; cached for {r['key']}")
        return 0
    if a.disagg:
        given = [f for f, v in (("--sweep", a.sweep), ("--output", a.output), ("--plot", a.plot)) if v]
        if given:
            raise ValueError(f"not with --disagg: {', '.join(given)}")
        return _run_disagg(a, flags, weight)
    if a.sweep:
        given = [f for f, v in (("--output", a.output), ("--plot", a.plot), ("--trace", a.trace),
                                ("--request-rate", a.request_rate)) if v is not None]
        if given:
            raise ValueError(f"not with --sweep: {', '.join(given)} (the sweep sets Poisson rates itself and writes "
                             "no files)")
        return _run_sweep(a, flags, weight)
    return _run_one(a, flags, weight)


def _setup_and_requests(a, flags: dict, weight: str, rate: float | None):
    from pagedkv.sim.run import prepare

    if a.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {a.num_prompts}")
    return prepare(a.model, a.gpu, a.tp, flags, weight, a.gpu_memory_utilization, a.kv_cache_memory, a.efficiency,
                   a.workload, a.num_prompts, rate,
                   dict(max_prompt_tokens=a.max_prompt_tokens, max_tokens=a.max_tokens, input_len=a.random_input_len,
                        output_len=a.random_output_len, range_ratio=a.random_range_ratio, trace=a.trace,
                        seed=a.workload_seed), a.spec_acceptance_rate)


def _check_outputs(a) -> None:
    """Refuse --output and --plot paths that cannot be written, before the run: a file name
    in an existing folder that takes a new file (tried), and for --plot a format matplotlib
    writes (without one, matplotlib appends .png to the name)."""
    for flag, path in (("--output", a.output), ("--plot", a.plot)):
        if path is None:
            continue
        if not path.strip() or Path(path).is_dir() or not Path(path).parent.is_dir():
            raise ValueError(f"{flag} {path!r}: not a file name in an existing folder")
        _try_write(flag, Path(path))
    if a.plot is not None:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        if Path(a.plot).suffix.lower().lstrip(".") not in formats:
            raise ValueError(f"--plot {a.plot!r}: name an image file matplotlib writes "
                             f"(.{', .'.join(sorted(formats))})")


def _try_write(flag: str, path: Path) -> None:
    """Open ``path`` for writing (and remove it again if it was not there): a folder that
    takes no file fails now, not after the run."""
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {str(path)!r}: cannot be written ({e.strerror})") from None
    if not existed:
        path.unlink(missing_ok=True)


def dumps(obj, **kw) -> str:
    """JSON text with non-finite numbers (an ``inf`` request rate, an infinite target) as the
    strings "inf", "-inf" and "nan" (vLLM's benchmarks write "inf" too): strict parsers and jq
    reject or mangle bare Infinity."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(obj), allow_nan=False, **kw)


def _run_one(a, flags: dict, weight: str) -> int:
    from pagedkv.sim.report import plot_timeline, render
    from pagedkv.sim.run import run_setup

    _check_outputs(a)
    setup, reqs = _setup_and_requests(a, flags, weight, a.request_rate)
    r = run_setup(setup, reqs)
    r.settings["request_rate"] = a.request_rate
    if a.output:
        with open(a.output, "w") as f:
            f.write(dumps(r.to_dict()))
    if a.plot:
        plot_timeline(r, a.plot)
    d = r.to_dict()
    d.pop("timeline")
    print(dumps(d, indent=2) if a.json else render(r))
    for what, path in (("result", a.output), ("plot", a.plot)):
        if path and not a.json:
            print(f"{what} written to {path}")
    return 0


def _run_disagg(a, flags: dict, weight: str) -> int:
    from pagedkv.sim.disagg import compare_disagg, parse_disagg

    num_prefill, num_decode = parse_disagg(a.disagg)
    if not (a.kv_link_gbps > 0 and a.ttft_slo > 0 and a.tpot_slo > 0):
        raise ValueError("--kv-link-gbps, --ttft-slo and --tpot-slo must be positive")
    setup, reqs = _setup_and_requests(a, flags, weight, a.request_rate)
    rows = compare_disagg(setup, reqs, a.model, a.tp, num_prefill, num_decode, a.kv_link_gbps * 1e9 / 8,
                          a.ttft_slo, a.tpot_slo)
    if a.json:
        print(dumps({"settings": setup.settings, "request_rate": a.request_rate, "kv_link_gbps": a.kv_link_gbps,
                          "ttft_slo_s": a.ttft_slo, "tpot_slo_s": a.tpot_slo, "rows": rows}, indent=2))
        return 0
    print(f"{len(reqs)} requests, {a.tp} device(s) per instance, KV link {a.kv_link_gbps:g} Gbit/s per device; "
          f"SLO: TTFT <= {a.ttft_slo:g} s and TPOT <= {a.tpot_slo:g} s")
    print(f"cost model: {setup.settings['efficiency']['source']}")
    print(f"{'setup':>14} {'in SLO':>7} {'TTFT p50/p90 (s)':>17} {'TPOT p50/p90 (ms)':>18} {'output tok/s':>13}")
    def ms(v):  # TPOT: none where every request had one output token
        return "-" if v is None else f"{1e3 * v:.2f}"

    for r in rows:
        print(f"{r['setup']:>14} {r['slo_attainment']:7.1%} {r['ttft_p50_s']:8.3f}/{r['ttft_p90_s']:<8.3f} "
              f"{ms(r['tpot_p50_s']):>8}/{ms(r['tpot_p90_s']):<9} {r['output_tokens_per_s']:13.1f}")
    return 0


def _run_sweep(a, flags: dict, weight: str) -> int:
    from pagedkv.sim.run import run_setup
    from pagedkv.sim.sweep import sweep

    metric, _, limit = a.target.partition("=")
    try:
        limit_s = float(limit)
    except ValueError:
        raise ValueError(f"--target is METRIC=SECONDS, got {a.target!r}") from None
    setup, reqs = _setup_and_requests(a, flags, weight, math.inf)
    best, points = sweep(lambda rq: run_setup(setup, rq).metrics, reqs, metric, limit_s, seed=a.workload_seed)
    if a.json:
        print(dumps({"target": metric, "limit_s": limit_s, "best_rate": best, "settings": setup.settings,
                          "points": [{"rate": p.rate, "value": p.value, "meets": p.meets} for p in points]}, indent=2))
        return 0
    if best is None:
        verdict = f"none: even {min(p.rate for p in points):g} req/s misses it"
    elif all(p.meets for p in points):
        verdict = (f"met at every rate tried, up to {best:g} req/s: {len(reqs)} requests then arrive almost at once "
                   "(raise --num-prompts, or tighten the target)")
    else:
        verdict = f"{best:.4g} req/s"
    print(f"{metric} <= {limit_s:g} s over {len(reqs)} requests: highest rate {verdict}")
    for p in sorted(points, key=lambda p: p.rate):
        v = "-" if p.value is None else f"{p.value:.6g}"
        print(f"  {p.rate:12.4g} req/s  {metric} {v} s  {'meets' if p.meets else 'misses'}")
    return 0
