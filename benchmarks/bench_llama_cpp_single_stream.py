"""llama.cpp's single-stream decode speed on the bundled GGUF, as the baseline for
``pagedkv bench latency`` (issue 17: single stream >= 1.0x llama.cpp).

llama-cpp-python (the prebuilt wheel in ``../shared/wheels``; not a test dependency) runs
the very Q4_1 GGUF pagedkv converts, 2 threads, greedy with EOS suppressed, on the first
arena-hard prompt. TPOT = (time of 65 output tokens - time of 1)
/ 64, so the prompt's prefill cancels out; median of ``--repeats``.

    pip install ../shared/wheels/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl
    python benchmarks/bench_llama_cpp_single_stream.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ARENA = Path(__file__).resolve().parents[2] / "shared" / "data" / "conversations" / "arena-hard-v0.1_question.jsonl"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    import llama_cpp

    from pagedkv.model.loader import _packaged_gguf

    llm = llama_cpp.Llama(model_path=str(_packaged_gguf("smollm2-135m-instruct")), n_ctx=1024, n_batch=512,
                          n_threads=a.threads, verbose=False)
    prompt = json.loads(ARENA.read_text().splitlines()[0])["prompt"]
    bias = {llm.token_eos(): -1e9}

    def run(n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.create_completion(prompt, max_tokens=n, temperature=0.0, logit_bias=bias)
        return time.perf_counter() - t
    run(4)  # warm-up
    tpots = [(run(65) - run(1)) / 64 for _ in range(a.repeats)]
    tpot = statistics.median(tpots)
    print(f"llama.cpp {llama_cpp.__version__} (Q4_1 GGUF, {a.threads} threads): single-stream decode "
          f"{1 / tpot:.1f} tok/s (TPOT {tpot * 1e3:.2f} ms, median of {a.repeats})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
