"""Single-stream decode step with every layer in one call (``decoder_stack``) vs one call
per layer, interleaved in one process so machine drift hits both alike.

One engine (default model, ``--activation-dtype``), one request past its prefill; blocks
of ``--steps`` decode steps alternate the two paths ``--rounds`` times; prints the median
step of each (milliseconds) and that the two paths give the same tokens and log-probs.

    python benchmarks/lab/ab_decoder_stack.py [--activation-dtype int8] [--rounds 10] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedkv import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--activation-dtype", default="int8")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    llm = LLM(num_blocks=256, activation_dtype=a.activation_dtype)
    eng, model = llm.engine, llm.engine.model
    check = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {}
    for on in (True, False):
        model.fused_stack = on
        outs[on] = [(o.token_ids, o.logprobs) for o in llm.generate(["Tell me a story.", "What is a KV cache?"], check)]
    print("identical tokens and log-probs:", outs[True] == outs[False])
    eng.add_request("Tell me a long story about a dragon and a knight.",
                    SamplingParams(max_tokens=a.rounds * a.steps * 2 + 50, temperature=0.0, ignore_eos=True))
    for _ in range(10):
        eng.step()
    ms = {True: [], False: []}
    for _ in range(a.rounds):
        for on in (True, False):
            model.fused_stack = on
            t = time.perf_counter()
            for _ in range(a.steps):
                eng.step()
            ms[on].append((time.perf_counter() - t) / a.steps * 1e3)
    print(f"stack {statistics.median(ms[True]):.2f} ms/step, per layer {statistics.median(ms[False]):.2f} ms/step "
          f"(medians of {a.rounds} blocks of {a.steps} steps)")


if __name__ == "__main__":
    main()
