"""The PagedAttention paper's capacity result, simulated (issue 15).

Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023), section 6.2 / figure 12: OPT-13B on one A100-40GB, ShareGPT-
and Alpaca-like lengths; paged allocation against Orca's contiguous reservation in three
policies, at the highest request rate each sustains under the same normalized-latency
target (mean end-to-end latency / output tokens).

Here: pagedkv's simulator (the engine's scheduler and KV manager on the roofline clock of
the planner's A100-40GB entry, no efficiency factors), fp16 weights and KV, 16-token
blocks, 256 sequences and 2,048 tokens per step at most, 90% of device memory. The
three reservation policies are the contiguous allocator (``--kv-allocator contiguous``:
prompt + ``max_tokens`` slots at admission) with ``max_tokens`` set per request to:
Max, ``max_model_len - prompt``; Pow2, the next power of two of the true output;
Oracle, the true output. Lengths: :mod:`pagedkv.sim.workloads` ``sharegpt-like`` /
``alpaca-like`` (the paper's means; the lognormal shape is ours).

    python benchmarks/sim_paper.py --output benchmarks/results/sim_paper.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from pagedkv.bench.workloads import with_poisson_arrivals
from pagedkv.config.engine import EngineConfig
from pagedkv.sim.run import run_setup, sim_setup
from pagedkv.sim.sweep import sweep
from pagedkv.sim.workloads import synthetic_workload

MAX_MODEL_LEN = 2048   # OPT's positions
SYSTEMS = ("paged", "orca-oracle", "orca-pow2", "orca-max")


def reserve(reqs, policy: str):
    """Each request's ``max_tokens`` (what a contiguous allocator reserves) under ``policy``."""
    out = []
    for r in reqs:
        room = MAX_MODEL_LEN - r.num_prompt_tokens
        want = {"max": room, "pow2": 1 << (r.output_len - 1).bit_length(), "oracle": r.output_len}[policy]
        out.append(replace(r, max_tokens=max(r.output_len, min(room, want))))
    return out


def system(name: str, reqs):
    if name == "paged":
        return {"kv_allocator": "paged"}, reserve(reqs, "max")
    return {"kv_allocator": "contiguous"}, reserve(reqs, name.split("-")[1])


def pool_fraction(setup, reqs, rate: float) -> float:
    """At ``rate``: the share of the whole pool's slots holding a token's KV, at the step
    where the most slots are allocated (the paper's figure 2 measures this share of the KV
    memory; the rest is reserved, internally fragmented or unused)."""
    run = run_setup(setup, with_poisson_arrivals(reqs, rate, 0)).run
    i = max(range(len(run.waste.allocated)), key=run.waste.allocated.__getitem__)
    return run.waste.filled[i] / (setup.num_blocks * setup.config.block_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--target", type=float, default=0.5, help="normalized latency target, s/token (default: 0.5)")
    p.add_argument("--workloads", default="sharegpt-like,alpaca-like")
    a = p.parse_args()
    t0, doc = time.time(), {"target_s_per_token": a.target, "num_prompts": a.num_prompts, "results": {}}
    for workload in a.workloads.split(","):
        base = synthetic_workload(workload, a.num_prompts, max_model_len=MAX_MODEL_LEN, seed=0)
        rows = {}
        for name in SYSTEMS:
            flags, reqs = system(name, base)
            config = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=256, max_num_batched_tokens=2048,
                                  enable_prefix_caching=False, **flags)
            setup = sim_setup("opt-13b", "a100-40gb", 1, config, "float16")
            best, points = sweep(lambda rq: run_setup(setup, rq).metrics, reqs, "normalized_latency", a.target,
                                 start=0.25)
            at_best = next(pt.metrics for pt in points if pt.rate == best) if best else None
            rows[name] = {"best_rate": best, "num_blocks": setup.num_blocks,
                          "tokens_of_allocated_slots": 1 - at_best["waste"] if at_best else None,
                          "tokens_of_pool_at_peak": pool_fraction(setup, reqs, best) if best else None,
                          "max_running_at_best": at_best["max_running"] if at_best else None,
                          "mean_running_at_best": at_best["mean_running"] if at_best else None,
                          "points": [{"rate": pt.rate, "normalized_latency_s": pt.value} for pt in points]}
            print(workload, name, json.dumps({k: v for k, v in rows[name].items() if k != "points"}), flush=True)
        paged = rows["paged"]["best_rate"]
        for name in SYSTEMS[1:]:
            other = rows[name]["best_rate"]
            rows[name]["paged_over_this"] = paged / other if paged and other else None
        doc["results"][workload] = rows
    doc["wall_s"] = time.time() - t0
    doc["command"] = (f"python benchmarks/sim_paper.py --output {a.output} --num-prompts {a.num_prompts} "
                      f"--target {a.target} --workloads {a.workloads}")
    with open(a.output, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
