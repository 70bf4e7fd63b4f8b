"""Scheduler + block-manager share of the engine step at batch 64 (goal: < 5%).

Runs the real model (default smollm2-135m-instruct) with ``--batch`` requests decoding
together and measures, over ``--steps`` decode steps, in two independent ways:

1. timers: ``Scheduler.schedule``, ``Scheduler.update`` and ``Scheduler.finish`` (every
   KV-manager call of a step happens inside these three) and ``ModelRunner.prepare``
   (building slot mappings and block-table tensors from the manager's tables; reported
   apart) are wrapped on the instances with ``time.perf_counter``; share = their sum /
   the sum of ``LLMEngine.step`` times.
2. cProfile over the same kind of steps: cumulative time of ``Scheduler.schedule`` +
   ``Scheduler.update`` + ``Scheduler.finish`` / cumulative time of ``LLMEngine.step``.
   cProfile charges a fixed cost per Python call, so this share is an over-estimate of
   the Python-heavy bookkeeping.

    python benchmarks/bench_step_overhead.py                    # about a minute on 2 cores
    python benchmarks/bench_step_overhead.py --batch 64 --steps 24 --json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

from pagedkv import SamplingParams
from pagedkv.bench.workloads import arena_hard_workload
from pagedkv.engine.engine import LLMEngine

BOOKKEEPING = ("schedule", "update", "finish")


def timed(obj, name: str, sink: dict) -> None:
    """Wrap ``obj.name`` (an instance attribute shadowing the method) to add its seconds to ``sink[name]``."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink[name] = sink.get(name, 0.0) + time.perf_counter() - t
    setattr(obj, name, wrapper)


def start_batch(engine: LLMEngine, batch: int, prompt_cap: int, steps: int) -> None:
    """Admit ``batch`` requests and run until all of them are decoding."""
    work = arena_hard_workload(engine.tokenizer, batch, prompt_cap, steps)
    params = SamplingParams(max_tokens=2 * steps + 4, temperature=0.0, ignore_eos=True)
    for r in work:
        engine.add_request({"prompt_token_ids": list(r.prompt_token_ids)}, params)
    sched = engine.scheduler
    while sched.waiting or any(q.num_computed_tokens < q.num_prompt_tokens for q in sched.running):
        engine.step()


def timer_share(engine: LLMEngine, steps: int) -> dict:
    sink: dict[str, float] = {}
    for name in BOOKKEEPING:
        timed(engine.scheduler, name, sink)
    timed(engine.runner, "prepare", sink)
    step_times = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t)
    finally:
        for name in BOOKKEEPING:
            del engine.scheduler.__dict__[name]
        del engine.runner.__dict__["prepare"]
    total = sum(step_times)
    book = sum(sink.get(n, 0.0) for n in BOOKKEEPING)
    return {"step_s_median": statistics.median(step_times), "step_s_total": total,
            "scheduler_kv_s": book, "scheduler_kv_share": book / total,
            "runner_prepare_s": sink.get("prepare", 0.0), "runner_prepare_share": sink.get("prepare", 0.0) / total,
            "by_function_s": sink}


def cprofile_share(engine: LLMEngine, steps: int, top: int) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    stats = pstats.Stats(prof)
    cum = {}
    for (file, _, func), (_, _, _, ct, _) in stats.stats.items():
        if file.endswith("scheduler.py") and func in BOOKKEEPING or file.endswith("engine.py") and func == "step":
            cum[func] = cum.get(func, 0.0) + ct
    book = sum(cum.get(n, 0.0) for n in BOOKKEEPING)
    lines = []
    stats.sort_stats("cumulative")
    for (file, line, func), (_, _, tt, ct, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:top]:
        lines.append(f"{ct:8.3f}s cum {tt:8.3f}s own  {file.split('/')[-1]}:{line}({func})")
    return {"step_s_total": cum.get("step", 0.0), "scheduler_kv_s": book,
            "scheduler_kv_share": book / cum["step"] if cum.get("step") else None, "top": lines}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=48, help="cap on each prompt (short: prefill is not measured)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--top", type=int, default=15, help="cProfile lines to print")
    ap.add_argument("--batch-invariant", action="store_true", help="16-row tiles for every matrix product")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    extra = {"batch_invariant": True} if a.batch_invariant else {}
    engine = LLMEngine(model=a.model, kv_cache_memory="1GiB", max_num_seqs=a.batch, **extra)
    start_batch(engine, a.batch, a.prompt_tokens, 2 * a.steps + 2)
    assert len(engine.scheduler.running) == a.batch
    timers = timer_share(engine, a.steps)
    prof = cprofile_share(engine, a.steps, a.top)
    res = {"batch": a.batch, "steps": a.steps, "batch_invariant": a.batch_invariant, "timers": timers, "cprofile": prof}
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"batch {a.batch} decode, {a.steps} steps each way")
    print(f"timers:   step median {timers['step_s_median'] * 1e3:.1f} ms; scheduler + KV manager "
          f"{timers['scheduler_kv_s'] * 1e3 / a.steps:.2f} ms/step = {100 * timers['scheduler_kv_share']:.2f}% "
          f"of step time; runner.prepare {100 * timers['runner_prepare_share']:.2f}%")
    print(f"cProfile: scheduler + KV manager {100 * prof['scheduler_kv_share']:.2f}% of LLMEngine.step "
          f"(over-estimate: per-call profiling cost)")
    print("\n".join(prof["top"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
