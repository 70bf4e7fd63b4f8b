"""Disaggregated prefill/decode, simulated: where splitting the two phases pays (DistServe,
Zhong et al., OSDI 2024) for models and devices we do not have.

``num_prefill`` prefill instances and ``num_decode`` decode instances, each the engine's own
scheduler and KV manager on its own virtual clock (:class:`~pagedkv.sim.engine.SimEngine`),
priced by the same cost model. A request goes to the least loaded prefill instance, which
computes its prompt and one token (the proxy's prefill leg); its KV then crosses to the least
loaded decode instance in ``paged KV bytes / link_bytes_per_s`` seconds, where it is admitted
as a prefix hit of the whole prompt (the decode instance computes only the last prompt token,
as the engine's consumer does) and generates every output token. The colocated baseline runs
``num_prefill + num_decode`` ordinary instances (the same devices) with requests spread the
same way. The instances advance in time order: the one whose next step starts first steps
next, so a transfer never lands in a decode instance's past.

Latencies are as a client of ``pagedkv proxy`` sees them: TTFT is the decode instance's first
token (after the prefill, the transfer and its queueing), TPOT the mean gap between its tokens.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass

from pagedkv.bench.metrics import RequestRecord, summarize_requests
from pagedkv.bench.workloads import BenchRequest
from pagedkv.connectors.base import KVConnector, KVConnectorScheduler, KVConnectorWorker
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.reprs import brief
from pagedkv.sim.engine import SimEngine


class _RemotePrefill(KVConnectorScheduler):
    """A decode instance's view: every prompt token's KV arrives from the prefill side."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        return max(0, request.num_prompt_tokens - num_computed_tokens)


def remote_prefill() -> KVConnector:
    return KVConnector(_RemotePrefill(), KVConnectorWorker())


@dataclass
class _Instance:
    engine: SimEngine
    arrivals: list  # heap of (time, seq, request index)

    def next_time(self) -> float:
        if self.engine.has_unfinished_requests():
            return self.engine.clock()
        return self.arrivals[0][0] if self.arrivals else math.inf

    def load(self) -> int:
        s = self.engine.scheduler
        return len(s.waiting) + len(s.running) + len(self.arrivals)


@dataclass
class DisaggResult:
    """Per-request records (arrival, the client-visible token times), summary metrics, and
    the instances' engines (prefill, then decode; the colocated ones count as prefill)."""
    records: list[RequestRecord]
    metrics: dict
    prefill_engines: list[SimEngine]
    decode_engines: list[SimEngine]


def run_disagg(setup, requests: list[BenchRequest], num_prefill: int, num_decode: int,
               link_bytes_per_s: float, page_bytes: int, block_size: int,
               ttft_slo_s: float, tpot_slo_s: float) -> DisaggResult:
    """Serve ``requests`` (their ``arrival_s``) on ``num_prefill`` prefill and ``num_decode``
    decode instances of ``setup`` (a :class:`~pagedkv.sim.run.SimSetup`); ``num_decode`` 0
    means colocated: ``num_prefill`` ordinary instances. ``page_bytes``: one page's KV bytes
    on one device, so a prompt of n tokens moves ``ceil(n / block_size) * page_bytes``.

    Raises:
        ValueError: no instances, a link that is not positive, or a request that can never fit.
    """
    if num_prefill < 1 or num_decode < 0 or not link_bytes_per_s > 0:
        raise ValueError("need at least one prefill instance and a positive link bandwidth")
    if (num_prefill + num_decode) * setup.num_blocks > MAX_TOTAL_BLOCKS:
        raise ValueError(f"{num_prefill + num_decode} instances of {setup.num_blocks:,} KV blocks each are more than "
                         f"the {MAX_TOTAL_BLOCKS:,} blocks simulated in memory at once: fewer instances, a larger "
                         "--block-size or a smaller --kv-cache-memory")
    colocated = num_decode == 0
    pre = [_Instance(setup.engine(), []) for _ in range(num_prefill)]
    dec = [_Instance(setup.engine(remote_prefill()), []) for _ in range(num_decode)]
    seq = 0
    for i, r in enumerate(requests):  # the least loaded at dispatch time: spread by arrival order here
        heapq.heappush(pre[i % num_prefill].arrivals, (r.arrival_s, seq := seq + 1, i))
    times: dict[int, list[float]] = {}
    live: dict[int, object] = {}  # generating requests by workload index
    while True:
        inst = min(pre + dec, key=_Instance.next_time)
        if inst.next_time() == math.inf:
            break
        full = colocated or inst in dec
        added = _admit(inst, requests, full)
        if full:
            live.update(added)
        for out in inst.engine.step():
            i = int(out.request_id)
            if full:
                if out.finished:
                    times[i] = list(live.pop(i).token_times)
            elif out.finished:  # prefill done: the KV crosses to a decode instance
                n = requests[i].prompt_token_ids
                ready = inst.engine.clock() + math.ceil(len(n) / block_size) * page_bytes / link_bytes_per_s
                target = min(dec, key=_Instance.load)
                heapq.heappush(target.arrivals, (ready, seq := seq + 1, i))
    records = [RequestRecord(r.arrival_s, len(r.prompt_token_ids), times.get(i, []), index=i)
               for i, r in enumerate(requests)]
    end = max((ts[-1] for ts in times.values() if ts), default=0.0)
    metrics = summarize_requests(records, end - min((r.arrival_s for r in requests), default=0.0))
    met = [r for r in records if r.token_times and r.ttft <= ttft_slo_s
           and (r.tpot is None or r.tpot <= tpot_slo_s)]
    metrics |= {"slo_attainment": len(met) / len(records) if records else 0.0,
                "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s,
                "instances": {"prefill": num_prefill, "decode": num_decode}}
    return DisaggResult(records, metrics, [x.engine for x in pre], [x.engine for x in dec])


def _admit(inst: _Instance, requests: list[BenchRequest], full: bool) -> dict:
    """Add the instance's arrivals due by the time its next step starts (an idle clock moves
    to the first of them); returns them by workload index. ``full``: generate every output
    token (decode or colocated); else the prefill leg's one token."""
    eng, added = inst.engine, {}
    if not eng.has_unfinished_requests() and inst.arrivals:
        eng.clock.set(max(eng.clock(), inst.arrivals[0][0]))
    while inst.arrivals and inst.arrivals[0][0] <= eng.clock():
        when, _, i = heapq.heappop(inst.arrivals)
        r = requests[i]
        params = SamplingParams(max_tokens=r.max_tokens if full else 1, temperature=0.0, ignore_eos=True)
        added[i] = eng.add_request({"prompt_token_ids": list(r.prompt_token_ids)}, params, str(i), arrival_time=when)
    return added


MAX_INSTANCES = 256  # X + Y: each instance holds an engine's scheduler and block pool
#: KV blocks of all instances simulated at once: a block's bookkeeping is ~90 bytes (31 MB an
#: instance of SmolLM2 on an H200 at 16 tokens a block), so this is ~3 GB
MAX_TOTAL_BLOCKS = 30_000_000


def parse_disagg(spec: str) -> tuple[int, int]:
    """``"2P1D"`` -> (2, 1): prefill and decode instances.

    Raises:
        ValueError: not of the form XPYD with X, Y >= 1, or more than :data:`MAX_INSTANCES` in all.
    """
    m = re.fullmatch(r"\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*", spec or "")
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"--disagg is XPYD with X, Y >= 1 (e.g. 2P1D), got {brief(spec)}")
    if int(m[1]) + int(m[2]) > MAX_INSTANCES:
        raise ValueError(f"--disagg {spec.strip()}: at most {MAX_INSTANCES} instances in all "
                         "(each is an engine in memory)")
    return int(m[1]), int(m[2])


def compare_disagg(setup, requests: list[BenchRequest], model: str, tp: int, num_prefill: int, num_decode: int,
                   link_bytes_per_s: float, ttft_slo_s: float, tpot_slo_s: float) -> list[dict]:
    """The same requests on ``num_prefill`` + ``num_decode`` disaggregated instances and on as
    many colocated ones: SLO attainment, TTFT and TPOT p50/p90 (seconds), output tokens/s."""
    from pagedkv.sim.run import sim_model

    s = setup.settings
    page = sim_model(model).kv_spec(s["kv_cache_dtype"], s["block_size"], tp).page_size_bytes
    rows = []
    for name, n_p, n_d in ((f"{num_prefill}P{num_decode}D", num_prefill, num_decode),
                           (f"colocated x{num_prefill + num_decode}", num_prefill + num_decode, 0)):
        m = run_disagg(setup, requests, n_p, n_d, link_bytes_per_s, page, s["block_size"], ttft_slo_s,
                       tpot_slo_s).metrics
        rows.append({"setup": name, "slo_attainment": m["slo_attainment"], "ttft_p50_s": m["ttft_s"]["p50"],
                     "ttft_p90_s": m["ttft_s"]["p90"], "tpot_p50_s": m["tpot_s"]["p50"],
                     "tpot_p90_s": m["tpot_s"]["p90"], "output_tokens_per_s": m["output_tokens_per_s"]})
    return rows
