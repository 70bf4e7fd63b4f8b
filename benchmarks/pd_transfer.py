"""KV transfer between a prefill and a decode engine, against this machine's loopback (issue 16).

Measures, in one run:

1. the loopback ceiling: a plain TCP socket from a child process to this one over
   127.0.0.1, ``--loopback-mib`` MiB (what any transport here can reach), measured three
   times at the start, once before each prompt length and three times at the end: this
   machine's rate moves by 2x within minutes, so each row is also set against the
   measurement taken just before it;
2. per prompt length, the decode side's pull of the prompt's pages from the prefill side
   (request, status, the pages sent from and received into the caches with an XXH3 check
   per chunk), ``--repeats`` fresh prompts each, the median seconds and GB/s (1e9 bytes),
   and the planner's figure for the same move: the prompt's paged KV bytes
   (``KVCacheSpec``, the arithmetic ``pagedkv plan`` prints) over the loopback rate.

The prefill engine runs in a child process (as its own `pagedkv serve` would), the decode
engine in this one, each with ``--threads`` torch threads (default 1: on this 2-core
machine each engine gets one core, as if on its own host). The decode side's pages are
touched once before the timed pulls (a running instance's steady state); the first pull
into untouched pages (the OS's page faults) is reported apart as ``cold_pull``.

    python benchmarks/pd_transfer.py --json benchmarks/results/pd_transfer.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time

from pagedkv import SamplingParams
from pagedkv.engine.engine import LLMEngine

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tp_equivalence import cpu_name  # noqa: E402


def _sender(port: int, nbytes: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        chunk, sent = b"\0" * (4 << 20), 0
        while sent < nbytes:
            s.sendall(chunk)
            sent += len(chunk)


def loopback_gbps(mib: int) -> float:
    """Bytes/s (GB/s) of one TCP stream over 127.0.0.1 from a child process."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    nbytes = mib << 20
    child = mp.get_context("spawn").Process(target=_sender, args=(srv.getsockname()[1], nbytes))
    child.start()
    conn, _ = srv.accept()
    buf, got = bytearray(4 << 20), 0
    t0 = time.perf_counter()
    while got < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    dt = time.perf_counter() - t0
    child.join()
    conn.close()
    srv.close()
    return got / dt / 1e9


def run(engine, prompt, params, rid):
    engine.add_request(prompt, params, rid)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def _producer(conn, kw: dict, cfg: dict, threads: int) -> None:
    """The prefill instance, in its own process (as `pagedkv serve` would be): prefills each
    prompt it is sent with max_tokens 1 and keeps its pages under a lease until pulled."""
    import torch
    torch.set_num_threads(threads)
    prod = LLMEngine(**kw, kv_transfer_config={**cfg, "kv_role": "kv_producer"})
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompt, tid = job
        run(prod, prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                                           "transfer_id": tid}), "p" + tid)
        conn.send("prefilled")
        while prod.has_unfinished_requests():  # until the consumer releases the lease
            prod.step()
    prod.close()


def pull_once(cons, conn, n: int, tag: str) -> tuple[int, float]:
    """Prefill a fresh n-token prompt there, decode it here; the pull's bytes and seconds."""
    worker = cons.runner.connector
    prompt = {"prompt_token_ids": [(7 * i + 13 * len(tag) + n + hash(tag)) % 40000 + 100 for i in range(n)]}
    conn.send((prompt, tag))
    assert conn.recv() == "prefilled"
    b0, s0 = worker.pulled_bytes, worker.pull_seconds
    run(cons, prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_prefill": True,
                                                                       "transfer_id": tag}), "d" + tag)
    return worker.pulled_bytes - b0, worker.pull_seconds - s0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="model of both engines (default: the default model)")
    p.add_argument("--lengths", default="256,1024,2048,4096", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="fresh prompts per length (default: 5)")
    p.add_argument("--loopback-mib", type=int, default=1024, help="MiB per loopback measurement (default: 1024)")
    p.add_argument("--kv-port", type=int, default=14900, help="the KV link's port (default: 14900)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV pages per engine (default: 512)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1: each "
                   "engine gets one of this machine's cores, as if on its own host)")
    p.add_argument("--json", help="also write the result to this file")
    a = p.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    loops = [loopback_gbps(a.loopback_mib) for _ in range(3)]
    cfg = {"kv_connector": "TorchDistConnector", "kv_port": a.kv_port, "kv_timeout_s": 60}
    kw = dict(model=a.model, num_blocks=a.num_blocks, enable_prefix_caching=False)
    conn, child_conn = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=_producer, args=(child_conn, kw, cfg, a.threads))
    child.start()
    assert conn.recv() == "ready"
    cons = LLMEngine(**kw, kv_transfer_config={**cfg, "kv_role": "kv_consumer"})
    worker = cons.runner.connector
    assert worker.link.ready.wait(60)
    # First touch: the consumer's pages are allocated uninitialized, so a page's first write
    # takes the OS's page faults. Measured once, then every page is touched (a running
    # decode instance's steady state) before the timed pulls.
    cold_bytes, cold_s = pull_once(cons, conn, max(map(int, a.lengths.split(","))), "cold")
    storage = cons.runner.storage  # nothing cached (prefix caching off): zeroing loses nothing
    for t in {id(t): t for layer in range(storage.num_layers) for t in storage.page_tensors(layer)}.values():
        t.zero_()
    rows = []
    for n in map(int, a.lengths.split(",")):
        beside = loopback_gbps(a.loopback_mib)
        loops.append(beside)
        secs, gbps = [], []
        for r in range(a.repeats):
            nbytes, dt = pull_once(cons, conn, n, f"{n}-{r}")
            secs.append(dt)
            gbps.append(nbytes / dt / 1e9)
            print(f"pull of {n} tokens: {dt * 1e3:.1f} ms", file=sys.stderr)
        rows.append({"prompt_tokens": n, "bytes": nbytes, "pull_seconds_median": statistics.median(secs),
                     "pull_seconds_all": secs,
                     "gbps_median": statistics.median(gbps), "loopback_gbps_beside": beside,
                     "fraction_of_loopback_beside": statistics.median(gbps) / beside,
                     "planner_bytes": cons.parts.kv_spec.paged_bytes_for_tokens(n - 1)})
    assert worker.num_failed_pulls == 0
    conn.send(None)
    child.join(60)
    cons.close()
    loops += [loopback_gbps(a.loopback_mib) for _ in range(3)]
    loop = statistics.median(loops)
    for row in rows:
        row["fraction_of_loopback"] = row["gbps_median"] / loop
        row["planner_seconds_at_loopback"] = row.pop("planner_bytes") / (loop * 1e9)
    doc = {"cpu": cpu_name(), "model": a.model, "kv_dtype": "float32", "threads_per_engine": a.threads,
           "loopback_gbps_median": loop,
           "loopback_gbps_all": loops, "cold_pull": {"bytes": cold_bytes, "seconds": cold_s,
                                                       "gbps": cold_bytes / cold_s / 1e9},
           "rows": rows, "command": "python benchmarks/pd_transfer.py " + " ".join(sys.argv[1:])}
    print(json.dumps(doc, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
