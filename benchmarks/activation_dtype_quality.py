"""The default activation dtype, decided by measurement (issue 51): int8 activations on the
GGUF's own blocks (llama.cpp's scheme, ``--activation-dtype int8``) against float32
activations on the same weights.

Two measures, as the issue sets them:

- perplexity of a text (wikitext-2 test by default) through the engine, float32 KV pages,
  ``--num-tokens`` tokens in ``--window``-token windows: goal within 0.5% of float32
  activations;
- teacher-forced greedy agreement on arena-hard chat prompts (:mod:`pagedkv.eval.agreement`):
  float32 activations generate greedy continuations, then int8 activations score the same
  prompt + continuation and the fraction of positions where their argmax is the continuation's
  token is counted: goal >= 98%. Float32 activations against themselves (a different batch
  and chunk shape) is the engine's noise floor.

    python benchmarks/activation_dtype_quality.py --file ../shared/data/wikitext-2-raw/wiki.test.raw
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedkv import LLM
from pagedkv.bench.workloads import arena_hard_workload
from pagedkv.eval.agreement import greedy_agreement
from pagedkv.eval.ppl import perplexity
from pagedkv.eval.settings import KVSetting


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", type=Path, required=True, help="text to score")
    p.add_argument("--num-tokens", type=int, default=16384)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--output", type=Path, help="write the results as JSON")
    a = p.parse_args()

    def llm(act: str) -> LLM:
        return LLM(activation_dtype=act, kv_cache_memory="1GiB")

    out = {"file": str(a.file), "num_tokens": a.num_tokens, "window": a.window}
    text_ids = None
    for act in ("float32", "int8"):
        engine = llm(act)
        if text_ids is None:
            text_ids = engine.get_tokenizer()(a.file.read_text(encoding="utf-8")).input_ids
        t0 = time.perf_counter()
        out[f"ppl_{act}"] = perplexity(engine, text_ids, a.num_tokens, a.window).ppl
        out[f"ppl_seconds_{act}"] = time.perf_counter() - t0
        del engine
    out["ppl_ratio"] = out["ppl_int8"] / out["ppl_float32"]

    tokenizer = llm("float32").get_tokenizer()
    prompts = [list(r.prompt_token_ids) for r in arena_hard_workload(tokenizer, a.num_prompts, 512, a.max_tokens)]
    base, floor, int8 = KVSetting("float32"), KVSetting("float32"), KVSetting("float32")
    acts = {id(base): "float32", id(floor): "float32", id(int8): "int8"}
    results = greedy_agreement(lambda s: llm(acts[id(s)]), prompts, a.max_tokens, [floor, int8], baseline=base)
    for name, r in zip(("float32", "int8"), results):
        out[f"teacher_forced_{name}"] = r.teacher_forced
        out[f"free_running_{name}"] = r.free_running
    out["num_agreement_tokens"] = results[0].num_tokens
    print(json.dumps(out, indent=1))
    print(f"perplexity: float32 activations {out['ppl_float32']:.4f}, int8 {out['ppl_int8']:.4f} "
          f"({(out['ppl_ratio'] - 1) * 100:+.2f}%; goal within 0.5%)")
    print(f"teacher-forced agreement with float32 activations: int8 {out['teacher_forced_int8']:.2%} "
          f"(goal >= 98%; float32 against itself {out['teacher_forced_float32']:.2%})")
    if a.output:
        a.output.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
