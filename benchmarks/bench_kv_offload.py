"""The CPU KV tier on a multi-turn replay (issue 12): mean TTFT of returning turns with the
tier vs without, when the KV cache is too small to keep every conversation.

hh-rlhf conversations (``../shared/data``, via ``pagedkv.bench.workloads``) are replayed
turn by turn, one request at a time, conversation after conversation: turn k of every
conversation, then turn k + 1 (each turn resent with its history, the model's own replies
included), so by the time a conversation returns, the other conversations have pushed
its prefix out of the KV cache. Both engines run the same requests (greedy, replies cut at
``--max-tokens``); TTFT is arrival to first token. Reported: mean TTFT of turns >= 2 per
engine (the median of ``--repeats`` interleaved replays) and the ratio, prompt tokens
computed, tier hit tokens, blocks loaded/saved, the tier's load bandwidth and time per
block, and whether the two engines produced the same tokens (batch-invariant mode is off
here, as in serving: equal tokens are expected, not promised).

    python benchmarks/bench_kv_offload.py --conversations 32 --turns 4 --kv-cache-memory 64MiB \
        --kv-offload-memory 2GiB --repeats 3

``--restart DIR``: the disk tier's warm restart instead. A 1,024-token shared system prompt
(the first tokens of *The Count of Monte Cristo*, ``../shared/data/long-context``) with a
question; TTFT cold (an engine on an empty ``DIR``), then after a restart on the same
``DIR`` with another question (the prefix comes from disk), medians of ``--repeats``
restarts; each engine is deleted before the next opens ``DIR``.

    python benchmarks/bench_kv_offload.py --restart /tmp/kvdisk --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedkv.bench.driver import drive
from pagedkv.bench.workloads import BenchRequest, chat_ids, hh_rlhf_conversations
from pagedkv.engine.engine import LLMEngine


def replay(engine, convs: list[list[str]], turns: int, max_tokens: int) -> list[dict]:
    tok, history, out = engine.tokenizer, [[] for _ in convs], []
    for k in range(turns):
        for i, conv in enumerate(convs):
            if len(conv) <= k:
                continue
            history[i].append({"role": "user", "content": conv[k]})
            ids = chat_ids(tok, history[i])
            rec = drive(engine, [BenchRequest(tuple(ids), max_tokens, max_tokens)], ignore_eos=False).records[0]
            out.append({"conv": i, "turn": k + 1, "prompt_tokens": len(ids), "cached": rec.num_cached_tokens,
                        "ttft": rec.ttft, "output": rec.output_token_ids})
            history[i].append({"role": "assistant",
                               "content": tok.decode(rec.output_token_ids, skip_special_tokens=True)})
    return out


def replay_run(a, convs: list[list[str]], extra: dict) -> dict:
    """One engine (``extra``: its tier settings) through the replay; mean TTFTs and counters."""
    engine = LLMEngine(kv_cache_memory=a.kv_cache_memory, max_model_len=a.max_model_len, **extra)
    fits = [c for c in convs if len(chat_ids(engine.tokenizer, [{"role": "user", "content": "\n".join(c)}]))
            + (a.max_tokens + 16) * a.turns <= a.max_model_len][:a.conversations]
    t = time.perf_counter()
    turns = replay(engine, fits, a.turns, a.max_tokens)
    wall = time.perf_counter() - t
    later = [r for r in turns if r["turn"] > 1]
    out = {"mean_ttft_turns_2plus_s": statistics.mean(r["ttft"] for r in later),
           "mean_ttft_turn_1_s": statistics.mean(r["ttft"] for r in turns if r["turn"] == 1),
           "requests": len(turns), "returning": len(later), "wall_s": wall,
           "prompt_tokens": sum(r["prompt_tokens"] for r in turns),
           "cached_tokens": sum(r["cached"] for r in turns),
           "kv_blocks": engine.stats().num_blocks, "tier": engine.stats().kv_offload,
           "outputs": [r["output"] for r in turns]}
    del engine
    return out


def median_run(rs: list[dict]) -> dict:
    """The run of median returning-turn TTFT (outputs dropped), with every run's TTFTs beside it."""
    out = dict(sorted(rs, key=lambda r: r["mean_ttft_turns_2plus_s"])[len(rs) // 2])
    out.pop("outputs")
    out["mean_ttft_turns_2plus_s_runs"] = [r["mean_ttft_turns_2plus_s"] for r in rs]
    return out


def restart(directory: str, repeats: int, prefix_tokens: int = 1024) -> dict:
    import gc
    import shutil
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "shared" / "data" / "long-context" / "pg1184.txt").read_text()
    args = dict(kv_cache_memory="256MiB", kv_offload_memory="1GiB", kv_offload_dir=directory)

    def ttft(question: str) -> tuple[float, dict]:
        engine = LLMEngine(**args)
        system = engine.tokenizer(text, add_special_tokens=False).input_ids[:prefix_tokens]
        ids = system + engine.tokenizer(question, add_special_tokens=False).input_ids
        rec = drive(engine, [BenchRequest(tuple(ids), 8, 8)]).records[0]
        stats = engine.stats().kv_offload
        del engine
        gc.collect()
        return rec.ttft, stats

    cold, warm, last = [], [], {}
    for r in range(repeats):
        shutil.rmtree(directory, ignore_errors=True)
        cold.append(ttft(f" Question {r}: who is the captain?")[0])
        t, last = ttft(f" Question {r}: where does the ship come from?")
        warm.append(t)
    return {"cold_ttft_s": cold, "warm_restart_ttft_s": warm,
            "ratio": statistics.median(cold) / statistics.median(warm),
            "prefix_tokens": prefix_tokens, "warm_engine_tier": last}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--kv-offload-memory", default="2GiB")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--restart", metavar="DIR", help="measure the disk tier's warm restart in DIR (emptied)")
    p.add_argument("--repeats", type=int, default=3, help="replays per engine (interleaved), or restarts")
    a = p.parse_args()
    if a.restart:
        print(json.dumps(restart(a.restart, a.repeats), indent=1))
        return 0
    convs = [c for c in hh_rlhf_conversations(4 * a.conversations, min_turns=a.turns, max_turns=a.turns)]
    runs: dict[str, list[dict]] = {"no tier": [], "cpu tier": []}
    for _ in range(a.repeats):  # interleaved, so drifts in this machine's speed hit both
        for name, extra in (("no tier", {}), ("cpu tier", {"kv_offload_memory": a.kv_offload_memory})):
            runs[name].append(replay_run(a, convs, extra))
    same = sum(x == y for x, y in zip(runs["no tier"][0]["outputs"], runs["cpu tier"][0]["outputs"]))
    results = {name: median_run(rs) for name, rs in runs.items()}
    a_, b_ = results["no tier"], results["cpu tier"]
    tier = b_["tier"]
    summary = {"ttft_ratio_turns_2plus": a_["mean_ttft_turns_2plus_s"] / b_["mean_ttft_turns_2plus_s"],
               "ttft_ratio_per_repeat": [x["mean_ttft_turns_2plus_s"] / y["mean_ttft_turns_2plus_s"]
                                         for x, y in zip(runs["no tier"], runs["cpu tier"])],
               "same_tokens_requests": same, "load_GBps": tier["bytes_read"] / max(tier["load_seconds"], 1e-9) / 1e9,
               "load_us_per_block": 1e6 * tier["load_seconds"] / max(tier["blocks_loaded"], 1)}
    print(json.dumps({"args": vars(a), "results": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
