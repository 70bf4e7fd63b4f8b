"""Quality of pagedkv's kept-quantized weights against llama.cpp on the same GGUF (issue 17):
perplexity on the same token windows, and greedy agreement on arena-hard prompts.

Both systems get identical token ids (pagedkv's tokenizer; no BOS added), so only the
arithmetic differs: pagedkv multiplies fp32 activations with the file's Q4_1/Q8_0 blocks
widened to fp32 (``--weight-dtype auto``), llama.cpp multiplies them in its own kernels
(on x86 it quantizes each activation row to 8 bits, Q8_1/Q8_0, for the integer dot
products). Perplexity: the first ``--num-tokens`` tokens of the text in non-overlapping
windows of ``--window``, each scoring tokens 1..W-1, as ``pagedkv eval ppl`` does; the
pagedkv figure comes from ``perplexity()`` in the same process. Greedy agreement: for each
prompt, the number of output tokens equal before the first difference (of ``--max-tokens``),
against llama.cpp and against pagedkv's own float32 weights (the same values, another
summation order), and llama.cpp against that float32 run.

    pip install ../shared/wheels/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl
    python benchmarks/llama_cpp_quality.py --file ../shared/data/wikitext-2-raw/wiki.test.raw
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np


def llama_cpp_nll(llm, wins: list[list[int]]) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and count of tokens 1..W-1 of each window."""
    total, count = 0.0, 0
    for w in wins:
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[: len(w) - 1], dtype=np.float64)
        logz = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
        total -= float((logits[np.arange(len(w) - 1), w[1:]] - logz).sum())
        count += len(w) - 1
    return total, count


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", required=True, help="text for perplexity (e.g. wikitext-2 wiki.test.raw)")
    p.add_argument("--num-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--activation-dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    import llama_cpp

    from pagedkv import LLM, SamplingParams
    from pagedkv.bench.workloads import arena_hard_workload
    from pagedkv.eval.ppl import perplexity, windows
    from pagedkv.model.loader import _packaged_gguf

    ours = LLM(weight_dtype=a.weight_dtype, activation_dtype=a.activation_dtype, kv_cache_dtype="float32",
               max_model_len=a.window + a.max_tokens + 512)
    tok = ours.get_tokenizer()
    with open(a.file, encoding="utf-8") as f:
        ids = tok(f.read()[: a.num_tokens * 12], add_special_tokens=False).input_ids
    ref = llama_cpp.Llama(model_path=str(_packaged_gguf("smollm2-135m-instruct")), n_ctx=a.window + a.max_tokens + 512,
                          n_batch=512, n_threads=a.threads, logits_all=True, verbose=False)
    nll, n = llama_cpp_nll(ref, windows(ids, a.num_tokens, a.window))
    mine = perplexity(ours, ids, a.num_tokens, a.window)
    work = arena_hard_workload(tok, a.num_prompts, 512, a.max_tokens)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in work]
    got = [o.token_ids for o in ours.generate(prompts, params)]
    del ours
    fp32 = [o.token_ids for o in LLM(weight_dtype="float32", kv_cache_dtype="float32").generate(prompts, params)]
    theirs = []
    for p in prompts:
        ref.reset()
        theirs.append([t for _, t in zip(range(a.max_tokens), ref.generate(p["prompt_token_ids"], temp=0.0, top_k=1))])
    vs_llama = [_common_prefix(x, y) for x, y in zip(got, theirs)]
    vs_fp32 = [_common_prefix(x, y) for x, y in zip(got, fp32)]
    out = {"llama_cpp_ppl": math.exp(nll / n), "pagedkv_ppl": mine.ppl, "scored_tokens": n,
           "ppl_ratio": mine.ppl / math.exp(nll / n), "weight_dtype": a.weight_dtype,
           "activation_dtype": a.activation_dtype, "num_prompts": len(prompts),
           "max_tokens": a.max_tokens, "greedy_prefix_vs_llama_cpp": vs_llama,
           "identical_vs_llama_cpp": sum(x == a.max_tokens for x in vs_llama),
           "greedy_prefix_vs_pagedkv_float32": vs_fp32,
           "identical_vs_pagedkv_float32": sum(x == a.max_tokens for x in vs_fp32),
           "llama_cpp_vs_pagedkv_float32": [_common_prefix(x, y) for x, y in zip(theirs, fp32)]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
