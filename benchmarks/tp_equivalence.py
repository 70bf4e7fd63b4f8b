"""Tensor parallelism on the real model: TP=N against TP=1, greedy, same prompts (issue 16).

Runs the first ``--num-prompts`` arena-hard prompts (chat template, capped at 512 tokens)
for ``--max-tokens`` greedy tokens on one engine, then on an engine split over
``--tensor-parallel-size`` processes (gloo on loopback), and reports: prompts whose tokens
are equal, the largest difference of a chosen token's log-prob, where the first differing
token is if any, and each engine's wall time (on a 2-core machine the ranks share the cores:
this shows correctness and the collectives' cost, not a speed-up).

    python benchmarks/tp_equivalence.py --num-prompts 8 --max-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.bench.workloads import arena_hard_workload


def run(tp: int, args, prompts) -> tuple[list, float, float]:
    """Outputs, start-up seconds and generate seconds of one engine."""
    t0 = time.perf_counter()
    llm = LLM(model=args.model, num_blocks=args.num_blocks, weight_dtype=args.weight_dtype,
              tensor_parallel_size=tp)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=1,
                                                ignore_eos=True))
    t2 = time.perf_counter()
    llm.close()
    return outs, t1 - t0, t2 - t1


def cpu_name() -> str:
    """This CPU's model name and its widest vector ISA (the figures differ by CPU kind)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    return f"{name} ({'AVX-512' if ' avx512f' in info else 'AVX2' if ' avx2' in info else 'no AVX2'})"


def compare(ref, got) -> dict:
    equal, first_diff, worst = 0, [], 0.0
    for a, b in zip(ref, got):
        equal += a.token_ids == b.token_ids
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        first_diff.append(n)
        upto = len(a.token_ids) if n is None else n + 1  # log-probs are comparable up to the first difference
        for i in range(upto):
            worst = max(worst, abs(a.logprobs[i][a.token_ids[i]] - b.logprobs[i][b.token_ids[i]]))
    return {"prompts_equal": equal, "prompts": len(ref), "first_differing_token": first_diff,
            "max_abs_logprob_diff": worst}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    probe = LLM(model=args.model, num_blocks=16)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in
               arena_hard_workload(probe.get_tokenizer(), args.num_prompts, 512, args.max_tokens)]
    probe.close()
    ref, start1, gen1 = run(1, args, prompts)
    got, start_n, gen_n = run(args.tensor_parallel_size, args, prompts)
    result = {"cpu": cpu_name(), "command": "python benchmarks/tp_equivalence.py " + " ".join(sys.argv[1:]),
              "threads": torch.get_num_threads(),
              "model": args.model, "weight_dtype": args.weight_dtype, "tp": args.tensor_parallel_size,
              "max_tokens": args.max_tokens, **compare(ref, got),
              "tp1_seconds": {"start": start1, "generate": gen1},
              "tpN_seconds": {"start": start_n, "generate": gen_n}}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
