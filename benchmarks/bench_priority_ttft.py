"""TTFT of a short request queued behind long prompts: ``fcfs`` vs ``priority`` scheduling.

Eight long prompts (slices of the bundled sonnet text) are queued, then one short prompt;
under ``--scheduling-policy priority`` the short one has priority -1 (the long ones 0), so
it is admitted in the first step that has budget left instead of after every long prefill.
Reports the short request's TTFT under each policy (median over ``--repeats``) and the
long requests' median TTFT, on the real model.

    python benchmarks/bench_priority_ttft.py                      # a few minutes on 2 cores
    python benchmarks/bench_priority_ttft.py --long-tokens 500 --repeats 1 --json
"""

from __future__ import annotations

import argparse
import json
import statistics

from pagedkv import LLM, SamplingParams
from pagedkv.data import load_sonnet


def run(llm: LLM, long_ids: list[list[int]], short_ids: list[int], policy: str) -> dict:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.reset_prefix_cache()
    prompts = [{"prompt_token_ids": ids} for ids in long_ids] + [{"prompt_token_ids": short_ids}]
    priority = [0] * len(long_ids) + [-1 if policy == "priority" else 0]
    outs = llm.generate(prompts, params, priority=priority)
    return {"short_ttft_s": outs[-1].ttft, "long_ttft_median_s": statistics.median(o.ttft for o in outs[:-1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long-prompts", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    results = {}
    for policy in ("fcfs", "priority"):
        llm = LLM(kv_cache_memory="1GiB", scheduling_policy=policy, enable_prefix_caching=False)
        ids = llm.get_tokenizer()(load_sonnet()).input_ids
        step = a.long_tokens
        long_ids = [ids[i * 97:i * 97 + step] for i in range(a.long_prompts)]
        runs = [run(llm, long_ids, ids[:8], policy) for _ in range(a.repeats)]
        results[policy] = {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"runs": runs}
        del llm
    if a.json:
        print(json.dumps(results))
        return 0
    for policy, r in results.items():
        print(f"{policy:9s} short TTFT {r['short_ttft_s']:.2f} s, long TTFT median {r['long_ttft_median_s']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
