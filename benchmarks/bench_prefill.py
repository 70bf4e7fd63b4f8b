"""Prefill speed against the compute bound, by prompt length (issue 17, goal 3).

One request per run, ``max_tokens=1``, prefix caching off: the time is the prompt's
prefill (chunked by ``--max-num-batched-tokens``) plus one sampled token. Prompts are
the first N tokens of *The Count of Monte Cristo* (``../shared/data/long-context``),
shifted per repeat. The compute bound prices the prefill's FLOPs at the fp32 matmul rate
measured in the same run (:class:`pagedkv.bench.roofline.Machine`):

    FLOPs = 2 * (matmul parameters) * N  +  attention 2 * layers * heads * 2 * head_dim * N(N+1)/2

(QK^T and PV, causal: query i sees i+1 keys; the LM head is applied to the last row only).
With ``--per-op`` the layers run op by op (no fused ``decoder_stack`` call), so the attention
calls (``paged_attention``) can be timed apart from the rest; the fused default runs them
inside one C++ call, where the column shows ``-``.

    python benchmarks/bench_prefill.py --lengths 1024,2048,4096,8191 --repeats 3 \
        [--activation-dtype int8] [--weight-dtype int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pagedkv.model.llama_layer as llama_layer_module
from pagedkv import LLM, SamplingParams
from pagedkv.bench.roofline import Machine, model_cost

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "long-context" / "pg1184.txt"


def timed_attention(sink: list[float]):
    inner = llama_layer_module.paged_attention

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink[0] += time.perf_counter() - t
    return inner, wrapper


def prefill_bound(cost, n: int, machine, int8: bool) -> float:
    """Seconds at the measured rates: everything at the fp32 rate, or (W8A8) the products at
    the int8 GEMM rate and attention at the fp32 one."""
    if not int8:
        return prefill_flops(cost, n) / machine.fp32_flops
    products = 2 * cost.layer_matmul_params * n + 2 * cost.lm_head_params
    return products / machine.int8_ops + cost.attn_flops_per_pair * n * (n + 1) / 2 / machine.fp32_flops


def prefill_flops(cost, n: int) -> float:
    """The planner's count: layer matmuls per token, the LM head once, attention per causal pair."""
    return 2 * cost.layer_matmul_params * n + 2 * cost.lm_head_params + cost.attn_flops_per_pair * n * (n + 1) / 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096,8191")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--activation-dtype", default="float32", help="int8: int8 activations (W8A8 with "
                   "--weight-dtype int8, or the GGUF's own blocks with auto); the bound then prices "
                   "the products at the int8 GEMM rate, attention at the fp32 one")
    p.add_argument("--per-op", action="store_true", help="run the layers op by op to time attention apart")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if not TEXT.is_file():
        p.error(f"the prompt text {TEXT} is missing (it comes from ../shared/data beside the checkout)")
    llm = LLM(max_model_len=max(lengths) + 1, num_blocks=(max(lengths) + 1) // 16 + 2, enable_prefix_caching=False,
              max_num_batched_tokens=a.max_num_batched_tokens, weight_dtype=a.weight_dtype,
              activation_dtype=a.activation_dtype)
    ids = llm.get_tokenizer()(TEXT.read_text(encoding="utf-8")[:200_000], add_special_tokens=False).input_ids
    cost = model_cost(llm.engine)
    llm.engine.model.fused_layers = not a.per_op
    machine = Machine.measure("probe")
    sink = [0.0]
    inner, wrapper = timed_attention(sink)
    llama_layer_module.paged_attention = wrapper
    rows = []
    try:
        llm.generate([{"prompt_token_ids": ids[:64]}], SamplingParams(max_tokens=1))  # warm-up (kernel load)
        for n in lengths:
            runs = []
            for r in range(a.repeats):
                machine = machine.best(Machine.measure("probe"))
                sink[0] = 0.0
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids[r * 97:r * 97 + n]}], SamplingParams(max_tokens=1))
                runs.append((time.perf_counter() - t, sink[0]))
            sec = statistics.median(x[0] for x in runs)
            att = statistics.median(x[1] for x in runs) if a.per_op else None
            rows.append({"tokens": n, "seconds": sec, "tokens_per_s": n / sec, "attention_s": att,
                         "attention_share": None if att is None else att / sec})
    finally:
        llama_layer_module.paged_attention = inner
    for r in rows:  # every row against the best rates of the whole run (the header's)
        r["compute_bound_s"] = prefill_bound(cost, r["tokens"], machine, a.activation_dtype == "int8")
        r["fraction_of_bound"] = r["compute_bound_s"] / r["seconds"]
    if a.json:
        print(json.dumps({"machine": machine.to_dict(), "rows": rows}))
        return 0
    print(f"fp32 matmul {machine.fp32_flops / 1e9:.0f} GFLOP/s, int8 GEMM {machine.int8_ops / 1e9:.0f} GOP/s "
          f"(best probes this run); medians of {a.repeats}; weights {a.weight_dtype}, activations {a.activation_dtype}")
    print(f"{'tokens':>7} {'seconds':>8} {'tok/s':>7} {'attention':>10} {'bound s':>8} {'of bound':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['seconds']:>8.2f} {r['tokens_per_s']:>7.1f} {_share(r['attention_share']):>10} "
              f"{r['compute_bound_s']:>8.2f} {r['fraction_of_bound']:>8.0%}")
    return 0


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


if __name__ == "__main__":
    raise SystemExit(main())
