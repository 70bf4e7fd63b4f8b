"""Scheduler step cost vs the number of running requests (pure Python, no model).

For each batch size N: admit N requests of ``--prompt-tokens`` tokens, then time decode
steps: ``Scheduler.schedule()`` (block allocation included), a fake runner's
``ModelRunnerOutput`` with one token per sampling request, ``Scheduler.update()``
(publishing full blocks, stop checks). Median
over ``--steps`` steps; the per-request cost should stay flat as N grows.

    python benchmarks/bench_scheduler.py                   # a few seconds
    python benchmarks/bench_scheduler.py --batches 1,64,256 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedkv.config import EngineConfig
from pagedkv.core.build import build_scheduler
from pagedkv.core.request import Request
from pagedkv.core.runner_io import ModelRunnerOutput, SampledTokens
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.core.scheduler import Scheduler
from pagedkv.kv.manager import KVCacheManager


def setup(n: int, prompt: int, steps: int, block_size: int, prefix_caching: bool) -> Scheduler:
    """A scheduler with ``n`` requests admitted and prefilled, room for ``steps`` more tokens each."""
    blocks = n * (-(-(prompt + steps + 2) // block_size) + 1)
    kv = KVCacheManager(blocks, block_size, enable_prefix_caching=prefix_caching)
    sched = build_scheduler(EngineConfig(max_num_seqs=n, max_num_batched_tokens=max(2048, n * prompt)), kv)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0)
    for i in range(n):
        req = Request(f"r{i}", [(7 * i + t) % 30000 + 1 for t in range(prompt)], params)
        req.max_tokens = steps + 2
        sched.add(req)
    step(sched, 0)   # prefill everyone
    return sched


def step(sched: Scheduler, token: int) -> float:
    """One schedule -> fake sample -> update; returns its seconds."""
    t = time.perf_counter()
    out = sched.schedule()
    sampled = {rid: SampledTokens([token]) for rid, start, n in out.chunks()
               if start + n == sched.requests[rid].num_tokens}
    sched.update(out, ModelRunnerOutput(sampled=sampled), 0.0)
    return time.perf_counter() - t


def measure(n: int, prompt: int, steps: int, block_size: int, prefix_caching: bool) -> dict:
    sched = setup(n, prompt, steps, block_size, prefix_caching)
    times = [step(sched, k + 1) for k in range(steps)]
    assert len(sched.running) == n, "every request should still be decoding"
    med = statistics.median(times)
    return {"running": n, "step_us": med * 1e6, "us_per_request": med * 1e6 / n, "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [measure(int(n), a.prompt_tokens, a.steps, a.block_size, a.prefix_caching) for n in a.batches.split(",")]
    if a.json:
        print(json.dumps({"rows": rows, "settings": vars(a)}))
        return 0
    print(f"scheduler decode step (schedule + update), prompt {a.prompt_tokens} tokens, "
          f"block {a.block_size}, prefix caching {'on' if a.prefix_caching else 'off'}; median of {a.steps} steps")
    print("| running | step us | us per request |\n| ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['running']} | {r['step_us']:.1f} | {r['us_per_request']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
