"""KV transfer between a prefill and a decode engine, against this machine's loopback (issue 16).

Measures, in one run:

1. the loopback ceiling: a plain TCP socket from a child process to this one over
   127.0.0.1, ``--loopback-mib`` MiB, median of 3 (what any transport here can reach);
2. per prompt length, the decode side's pull of the prompt's pages from the prefill side
   (request, page copy out, CRC-32, send over the gloo link, CRC check, page copy in),
   ``--repeats`` prompts each, the median seconds and GB/s (1e9 bytes), and the planner's
   figure for the same move: the prompt's paged KV bytes (``KVCacheSpec``, the arithmetic
   ``pagedkv plan`` prints) over the loopback rate just measured.

Both engines live in this process (their link is still TCP over loopback, served by the
producer's thread); on a 2-core machine they share the cores.

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lengths", default="256,1024,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loopback-mib", type=int, default=1024)
    p.add_argument("--kv-port", type=int, default=14900)
    p.add_argument("--json")
    a = p.parse_args()
    loop = statistics.median(loopback_gbps(a.loopback_mib) for _ in range(3))
    cfg = {"kv_connector": "TorchDistConnector", "kv_port": a.kv_port, "kv_timeout_s": 60}
    kw = dict(model=a.model, num_blocks=512, enable_prefix_caching=False)
    prod = LLMEngine(**kw, kv_transfer_config={**cfg, "kv_role": "kv_producer"})
    cons = LLMEngine(**kw, kv_transfer_config={**cfg, "kv_role": "kv_consumer"})
    worker = cons.runner.connector
    assert worker.link.ready.wait(60) and prod.runner.connector.link.ready.wait(60)
    rows = []
    for n in map(int, a.lengths.split(",")):
        secs, gbps = [], []
        for r in range(a.repeats):
            prompt, tid = {"prompt_token_ids": [(7 * i + 13 * r + n) % 40000 + 100 for i in range(n)]}, f"{n}-{r}"
            run(prod, prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                                               "transfer_id": tid}), "p" + tid)
            b0, s0 = worker.pulled_bytes, worker.pull_seconds
            run(cons, prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_prefill": True,
                                                                               "transfer_id": tid}), "d" + tid)
            while prod.has_unfinished_requests():
                prod.step()
            nbytes, dt = worker.pulled_bytes - b0, worker.pull_seconds - s0
            secs.append(dt)
            gbps.append(nbytes / dt / 1e9)
        bound = cons.parts.spec.paged_bytes_for_tokens(n - 1) / (loop * 1e9)
        rows.append({"prompt_tokens": n, "bytes": nbytes, "pull_seconds_median": statistics.median(secs),
                     "gbps_median": statistics.median(gbps), "fraction_of_loopback": statistics.median(gbps) / loop,
                     "planner_seconds_at_loopback": bound})
    assert worker.num_failed_pulls == 0
    prod.close()
    cons.close()
    doc = {"cpu": cpu_name(), "model": a.model, "kv_dtype": "float32", "loopback_gbps_median": loop,
           "rows": rows, "command": "python benchmarks/pd_transfer.py " + " ".join(sys.argv[1:])}
    print(json.dumps(doc, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
