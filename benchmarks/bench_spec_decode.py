"""Speculative decoding with n-gram drafts vs plain decoding (issue 13), on the default model.

Two workloads, each under the model's chat template, greedy:

- ``edit`` (input-grounded): the bundled sonnets (``pagedkv/data/sonnet.txt``, public
  domain; Apache-2.0 as vLLM ships it), 14 lines per prompt, with an instruction to rewrite
  it in modern spelling, so much of the answer is in the prompt (the 135M model follows it
  loosely: it copies lines, changes some, and often falls into repeating itself, which
  drafts from its own output then predict);
- ``chat`` (open-ended): arena-hard v0.1 prompts (bundled, Apache-2.0).

``--batch 1`` runs one request at a time (single stream); a larger batch submits that many
requests at once (repeating prompts as needed). Two rates: end to end (all output tokens /
all wall time, prefills included) and decode (output tokens after each request's first /
the time after its first token: what speculation changes). Each setting runs
``--repeats`` times, interleaved with the other; reported: the median of each rate per
setting, the ratios, the draft acceptance rate and the mean accepted
length (tokens per verification step), and how many requests produced the same tokens
(batch-invariant mode is off, as in serving: the same tokens are expected, not promised).

    python benchmarks/bench_spec_decode.py --workload edit --batch 1 --requests 8 --max-tokens 160
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedkv import LLM, SamplingParams
from pagedkv.bench.workloads import chat_ids
from pagedkv.data import load_arena_hard, load_sonnet

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
EDIT = ("Here is a poem with old spelling. Rewrite it with modern spelling (you instead of thou/thee/thy). "
        "Output only the rewritten poem.\n\n")


def messages(workload: str, n: int) -> list[list[dict]]:
    if workload == "edit":
        lines = load_sonnet().splitlines()
        sonnets = ["\n".join(lines[i:i + 14]) for i in range(0, len(lines) - 13, 14)]  # 14 lines each
        return [[{"role": "user", "content": EDIT + sonnets[i % len(sonnets)]}] for i in range(n)]
    prompts = [p for p in load_arena_hard() if len(p) < 600]
    return [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(n)]


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[dict, list[list[int]]]:
    """End-to-end and decode tokens/s over ``prompts``, ``batch`` at a time; and the outputs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs, t = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], params)
    wall = time.perf_counter() - t
    decode_s = sum(o.e2e - o.ttft for o in outs if len(o.token_ids) > 1)
    rates = {"e2e": sum(len(o.token_ids) for o in outs) / wall,
             "decode": sum(len(o.token_ids) - 1 for o in outs) / decode_s}
    return rates, [o.token_ids for o in outs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("edit", "chat"), default="edit")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--speculative-config", default=json.dumps(SPEC))
    p.add_argument("--out")
    a = p.parse_args()
    engines = {"off": LLM(), "spec": LLM(speculative_config=a.speculative_config)}
    tok = engines["off"].get_tokenizer()
    prompts = [chat_ids(tok, m) for m in messages(a.workload, a.requests)]
    for llm in engines.values():  # warm up: kernels, thread pools
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8, temperature=0.0))
    rates, outputs = {k: {"e2e": [], "decode": []} for k in engines}, {}
    before = engines["spec"].stats().spec_decode
    for _ in range(a.repeats):
        for name, llm in engines.items():
            rate, outs = run(llm, prompts, a.batch, a.max_tokens)
            for kind, v in rate.items():
                rates[name][kind].append(v)
            outputs[name] = outs
    s = engines["spec"].stats().spec_decode
    drafts, drafted, accepted = (s[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    med = {k: {kind: statistics.median(v) for kind, v in r.items()} for k, r in rates.items()}
    report = {"args": vars(a), "tokens_per_s": rates, "median_tokens_per_s": med,
              "ratio_e2e": med["spec"]["e2e"] / med["off"]["e2e"],
              "ratio_decode": med["spec"]["decode"] / med["off"]["decode"],
              "acceptance_rate": accepted / drafted if drafted else None,
              "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
              "same_tokens_requests": sum(x == y for x, y in zip(outputs["off"], outputs["spec"])),
              "output_tokens": sum(len(o) for o in outputs["off"]), "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
