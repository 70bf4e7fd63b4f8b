"""Swap vs recompute preemption on a capacity-bound workload (issue 12).

``--requests`` passages of *The Count of Monte Cristo* (``../shared/data/long-context``,
public domain), ``--prompt-tokens`` each, all arriving at once, each continued greedily for
``--max-tokens`` tokens (EOS ignored), on a KV cache that holds every prompt but not every
request's growth: the scheduler admits requests while their prompts fit, then preempts as
their outputs grow past the cache. The same requests run under four settings:

- ``recompute``: no CPU tier (the engine's default);
- ``recompute+tier``: the CPU tier on, preemption by recompute (the tier's write-through
  prefix blocks spare part of the recompute);
- ``swap`` and ``auto`` (``--preemption-mode``) with the same tier.

Reported per setting: wall time, output tokens/s, preemptions by mode, blocks swapped out and
in, and the swap copies' bandwidth (bytes / seconds inside the copies) as a fraction of this
machine's copy bandwidth measured in the same run (best of 5 streaming copies of 256 MiB,
:func:`pagedkv.planner.cpu.measure`) and of its page-piece copy rate at the model's piece
size (:func:`pagedkv.planner.cpu.page_copy_bandwidth`). For ``auto``: what it chose, with its
predicted seconds each way. Also: whether each setting's tokens equal the first one's
(batch-invariant mode is off, as in serving: expected, not promised).

    python benchmarks/bench_swap_preemption.py --requests 16 --prompt-tokens 256 --max-tokens 512 \
        --kv-cache-memory 128MiB --kv-offload-memory 2GiB --repeats 3 --out benchmarks/results/swap_preemption.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from pagedkv.bench.driver import drive, warm_up
from pagedkv.bench.workloads import BenchRequest
from pagedkv.engine.engine import LLMEngine
from pagedkv.planner.cpu import measure, page_copy_bandwidth

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "long-context" / "pg1184.txt"
SETTINGS = {"recompute": {}, "recompute+tier": {"tier": True}, "swap": {"tier": True, "mode": "swap"},
            "auto": {"tier": True, "mode": "auto"}}


def workload(tokenizer, n: int, prompt_tokens: int, max_tokens: int) -> list[BenchRequest]:
    ids = tokenizer(TEXT.read_text(), add_special_tokens=False).input_ids
    start = 2000  # past the front matter
    return [BenchRequest(tuple(ids[start + i * prompt_tokens:start + (i + 1) * prompt_tokens]), max_tokens, max_tokens)
            for i in range(n)]


def run(name: str, args, reqs: list[BenchRequest] | None) -> tuple[dict, list, list[BenchRequest]]:
    s = SETTINGS[name]
    engine = LLMEngine(kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.requests,
                       kv_offload_memory=args.kv_offload_memory if s.get("tier") else None,
                       preemption_mode=s.get("mode", "recompute"))
    reqs = reqs or workload(engine.tokenizer, args.requests, args.prompt_tokens, args.max_tokens)
    warm_up(engine)
    r = drive(engine, reqs)
    st = engine.stats()
    out = {"setting": name, "wall_s": r.duration_s, "output_tokens": sum(len(x.output_token_ids) for x in r.records),
           "preemptions": st.num_preemptions, "preemptions_by_mode": st.preemptions_by_mode,
           "num_blocks": st.num_blocks}
    out["output_tokens_per_s"] = out["output_tokens"] / r.duration_s
    o = st.kv_offload
    if o:
        out |= {k: o[k] for k in ("swap_outs", "swap_ins", "swap_blocks_out", "swap_blocks_in", "swap_no_room",
                                  "swap_bytes", "swap_seconds", "hit_tokens", "blocks_loaded", "load_seconds")}
        out["swap_bytes_per_s"] = o["swap_bytes"] / o["swap_seconds"] if o["swap_seconds"] else None
    if s.get("mode") == "auto":
        d = list(engine.scheduler.preemption.decisions)
        out["auto"] = {"swap": sum(x.mode == "swap" for x in d), "recompute": sum(x.mode == "recompute" for x in d),
                       "median_predicted_swap_s": _median([x.swap_s for x in d]),
                       "median_predicted_recompute_s": _median([x.recompute_s for x in d]),
                       "flop_rate": engine.scheduler.preemption.flop_rate}
    tokens = [x.output_token_ids for x in sorted(r.records, key=lambda x: x.index)]
    piece = engine.parts.kv_spec.page_size_bytes // (engine.parts.kv_spec.num_layers * 2)
    out["page_piece_bytes"] = piece
    del engine
    gc.collect()
    return out, tokens, reqs


def median_run(rs: list[dict]) -> dict:
    """The run of median wall time, with every run's wall time, tokens/s and swap rate beside it."""
    out = dict(sorted(rs, key=lambda r: r["wall_s"])[len(rs) // 2])
    out["runs"] = [{k: r.get(k) for k in ("wall_s", "output_tokens_per_s", "swap_bytes_per_s", "preemptions")}
                   for r in rs]
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="128MiB")
    p.add_argument("--kv-offload-memory", default="2GiB")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--repeats", type=int, default=3, help="runs per setting, interleaved; medians reported")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    runs, first, reqs = {}, None, None
    for _ in range(args.repeats):
        for name in args.settings.split(","):
            res, tokens, reqs = run(name, args, reqs)
            first = first or tokens
            res["requests_equal_to_first_setting"] = sum(a == b for a, b in zip(tokens, first))
            runs.setdefault(name, []).append(res)
            print(json.dumps(res), flush=True)
    m = measure(repeats=5)
    piece_rate = page_copy_bandwidth(next(iter(runs.values()))[0]["page_piece_bytes"])
    results = [median_run(rs) for rs in runs.values()]
    for res in results:
        if res.get("swap_bytes_per_s"):
            res["swap_fraction_of_stream_copy"] = res["swap_bytes_per_s"] / m["copy_bandwidth_bytes_per_s"]
            res["swap_fraction_of_page_copy"] = res["swap_bytes_per_s"] / piece_rate
    report = {"results": results, "machine": {"copy_bandwidth_bytes_per_s": m["copy_bandwidth_bytes_per_s"],
                                              "read_bandwidth_bytes_per_s": m["read_bandwidth_bytes_per_s"],
                                              "page_piece_copy_bytes_per_s": piece_rate},
              "args": vars(args), "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
