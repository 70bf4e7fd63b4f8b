"""The seed's example, simulated: Llama-3-70B fp16, 32 requests of 4,096 tokens, A100-80GB
at TP 2, 4 and 8 (issue 15).

Each request is a 2,048-token prompt and 2,048 output tokens, all arriving at once. For
each TP degree: the pool the planner sizes, what batch actually runs (the most requests
running at once, and on average), preemptions, the simulated decode step (TPOT p50)
beside the planner's lower bound for a decode step at that batch and the full 4,096-token
context, and output tokens/s. Plain roofline (no efficiency factors): the simulated step
differs from the planner's bound only by what the schedule does (batch, contexts, prefill
chunks mixed in).

    python benchmarks/sim_seed_example.py
"""

from __future__ import annotations

import json

from pagedkv.bench.workloads import BenchRequest
from pagedkv.planner.plan import plan
from pagedkv.sim.run import simulate

PROMPT, OUTPUT, N = 2048, 2048, 32


def main() -> None:
    reqs = [BenchRequest(tuple(range(1 + i * PROMPT, 1 + (i + 1) * PROMPT)), OUTPUT, OUTPUT) for i in range(N)]
    rows = []
    for tp in (2, 4, 8):
        r = simulate("llama-3-70b", "a100-80gb-sxm4", tp=tp, workload=reqs, kv_cache_dtype="float16",
                     weight_dtype="float16", max_model_len=8192)
        m = r.metrics
        batch = m["max_running"]
        bound = plan("llama-3-70b", "a100-80gb-sxm4", kv_cache_dtype="fp16", weight_dtype="fp16",
                     seq_len=PROMPT + OUTPUT, batch=batch, tp=tp).decode
        rows.append({"tp": tp, "num_blocks": r.settings["num_blocks"], "max_running": batch,
                     "mean_running": round(m["mean_running"], 1), "preemptions": m["preemptions"],
                     "tpot_p50_ms": round(1e3 * m["tpot_s"]["p50"], 2),
                     "planner_decode_bound_ms": round(1e3 * bound.seconds, 2),
                     "output_tokens_per_s": round(m["output_tokens_per_s"], 1),
                     "duration_s": round(m["duration_s"], 1), "ttft_p50_s": round(m["ttft_s"]["p50"], 2)})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
