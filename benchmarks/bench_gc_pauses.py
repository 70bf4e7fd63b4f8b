"""The cyclic garbage collector's pauses during single-stream decoding, with and without ``gc.freeze()``.

Loads the default model (``LLM(activation_dtype=...)``), optionally freezes every object
alive after the load (as ``pagedkv serve`` does, :func:`pagedkv.server.cli.freeze_long_lived`),
then decodes ``--rounds`` x ``--max-tokens`` greedy tokens and reports each generation's
collections, their total and longest pause (``gc.callbacks``), and the wall time.

    python benchmarks/bench_gc_pauses.py [--freeze] [--rounds 4 --max-tokens 256]
"""

from __future__ import annotations

import argparse
import gc
import time

from pagedkv import LLM, SamplingParams

PROMPT = "Tell me a long story about a dragon and a knight."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--freeze", action="store_true", help="gc.collect(); gc.freeze() after the load")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--activation-dtype", default="int8")
    a = p.parse_args()
    llm = LLM(activation_dtype=a.activation_dtype)
    if a.freeze:
        gc.collect()
        gc.freeze()
    print(f"objects the collector tracks: {len(gc.get_objects()):,}; frozen: {gc.get_freeze_count():,}")
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    start = {}

    def timed(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - start["t"])

    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    gc.callbacks.append(timed)
    t = time.perf_counter()
    for _ in range(a.rounds):
        llm.generate([PROMPT], sp)
    wall = time.perf_counter() - t
    gc.callbacks.remove(timed)
    for g, v in pauses.items():
        print(f"generation {g}: {len(v)} collections, {1e3 * sum(v):.1f} ms in all, longest "
              f"{1e3 * max(v, default=0.0):.2f} ms")
    print(f"{a.rounds * a.max_tokens} tokens in {wall:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
