"""Pull after the prefill vs layer-by-layer push during it: what the decode leg waits for (issue 16).

Two prefill instances in child processes, one with ``kv_send_type`` ``GET`` (the decode side
pulls the prompt's pages once the prefill has ended) and one with ``PUT_ASYNC`` (each layer's
pages are pushed as soon as that layer has written them, while the rest of the prefill
computes), each linked to a decode engine in this process. Per prompt length and round, the
two modes run one after the other on fresh prompts (alternating which goes first), and for
each the script records:

- ``prefill_s``: the prefill leg (``max_tokens`` 1) on the producer, from its first step to its
  last (pushing copies each layer's pages out of the cache in the engine thread; the sends
  run in a thread beside it);
- ``load_s``: what the decode leg's first step waits for the prompt's pages: the pull, or the
  copy out of the push buffer (plus any last layers still on the wire);
- ``decode_leg_s``: the decode leg's first token (that step's load, the last prompt token's
  forward, sampling);
- ``ttft_s``: ``prefill_s`` + the hand-over to this process + ``decode_leg_s``: the time to
  first token a proxy's client would see, less HTTP.

The decode engines' pages are touched once before anything is timed (a running instance's
steady state), and one warm-up prompt per mode runs first. Each engine gets ``--threads``
torch threads (default 1: on a 2-core machine each engine has a core, as if on its own host;
the push sender thread shares the prefill engine's).

    python benchmarks/pd_push_overlap.py --json benchmarks/results/pd_push_overlap.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

from pagedkv import SamplingParams
from pagedkv.engine.engine import LLMEngine

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pd_transfer import run  # noqa: E402
from tp_equivalence import cpu_name  # noqa: E402

MODES = ("GET", "PUT_ASYNC")


def _producer(conn, kw: dict, cfg: dict, threads: int) -> None:
    """A prefill instance: prefills each prompt it is sent (max_tokens 1), answers its
    seconds, then steps until the consumer has released the pages."""
    import torch
    torch.set_num_threads(threads)
    prod = LLMEngine(**kw, kv_transfer_config={**cfg, "kv_role": "kv_producer"})
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompt, tid = job
        t0 = time.perf_counter()
        run(prod, prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                                           "transfer_id": tid}), "p" + tid)
        conn.send(("prefilled", time.perf_counter() - t0, time.perf_counter()))
        while prod.has_unfinished_requests():
            prod.step()
    conn.send(prod.runner.connector.transfer_stats())
    prod.close()


def once(cons, conn, n: int, tag: str) -> dict:
    """A fresh n-token prompt: prefilled there, its first token here; the seconds."""
    worker = cons.runner.connector
    prompt = {"prompt_token_ids": [(7 * i + 13 * len(tag) + n + hash(tag)) % 40000 + 100 for i in range(n)]}
    conn.send((prompt, tag))
    msg, prefill_s, done_at = conn.recv()
    assert msg == "prefilled"
    s0, t0 = worker.pull_seconds, time.perf_counter()
    run(cons, prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_prefill": True,
                                                                       "transfer_id": tag}), "d" + tag)
    leg = time.perf_counter() - t0
    return {"prefill_s": prefill_s, "load_s": worker.pull_seconds - s0, "decode_leg_s": leg,
            "ttft_s": prefill_s + (t0 - done_at) + leg}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="rounds per length (each: one prompt per mode)")
    p.add_argument("--kv-port", type=int, default=14950, help="the first mode's KV port (the second: +1)")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the prefill's chunk (default: 2048)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the result to this file")
    a = p.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    kw = dict(model=a.model, num_blocks=a.num_blocks, enable_prefix_caching=False,
              max_num_batched_tokens=a.max_num_batched_tokens)
    ends = {}
    for i, mode in enumerate(MODES):
        cfg = {"kv_connector": "TorchDistConnector", "kv_port": a.kv_port + i, "kv_timeout_s": 60}
        conn, child_conn = mp.get_context("spawn").Pipe()
        mp.get_context("spawn").Process(target=_producer, args=(child_conn, kw, cfg | {"kv_send_type": mode},
                                                                  a.threads)).start()
        assert conn.recv() == "ready"
        cons = LLMEngine(**kw, kv_transfer_config={**cfg, "kv_role": "kv_consumer"})
        assert cons.runner.connector.link.ready.wait(60)
        storage = cons.runner.storage  # every page touched once (a running decode instance's steady
        for layer in range(storage.num_layers):  # state): a first write's page faults cost 2-3 ms a MB on this VM
            for t in storage.page_tensors(layer):
                t.zero_()
        ends[mode] = (conn, cons)
    for mode, (conn, cons) in ends.items():  # warm-up: first touches of both sides' pages
        once(cons, conn, max(map(int, a.lengths.split(","))), f"warm-{mode}")
    rows = []
    for n in map(int, a.lengths.split(",")):
        got = {m: [] for m in MODES}
        for r in range(a.repeats):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                conn, cons = ends[mode]
                got[mode].append(once(cons, conn, n, f"{mode}-{n}-{r}"))
                print(f"{mode} {n} tokens: {got[mode][-1]}", file=sys.stderr)
        row = {"prompt_tokens": n}
        for mode, runs in got.items():
            row[mode] = {k: statistics.median(x[k] for x in runs) for k in runs[0]} | {"all": runs}
        rows.append(row)
    stats = {}
    for mode, (conn, cons) in ends.items():
        conn.send(None)
        stats[mode] = {"producer": conn.recv(), "consumer": cons.runner.connector.transfer_stats()}
        cons.close()
    doc = {"cpu": cpu_name(), "model": a.model, "kv_dtype": "float32", "threads_per_engine": a.threads,
           "max_num_batched_tokens": a.max_num_batched_tokens, "rows": rows, "transfer_stats": stats,
           "command": "python benchmarks/pd_push_overlap.py " + " ".join(sys.argv[1:])}
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"} | {"rows": [
        {"prompt_tokens": r["prompt_tokens"], **{m: {k: v for k, v in r[m].items() if k != "all"} for m in MODES}}
        for r in rows]}, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
