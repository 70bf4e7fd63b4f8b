"""Prometheus metrics for ``GET /metrics`` (prometheus-client, one registry per app).

Gauges and engine counters are read from the engine loop's latest ``EngineStats``
snapshot at scrape time; latency histograms and token counters are fed by the engine
thread as outputs arrive. Units: seconds, tokens, blocks (``block_size`` tokens each).

    pagedkv_kv_blocks{state="used|cached|free"}     blocks in each state (cached = evictable)
    pagedkv_kv_blocks_total / _kv_cache_usage_ratio  pool size; used / total
    pagedkv_prefix_cache_{queries,hits}_tokens_total prompt tokens looked up / found
    pagedkv_num_requests_{running,waiting}           scheduler queues
    pagedkv_num_preemptions_total                    preemptions (recompute or swap)
    pagedkv_kv_offload_*{tier="cpu|disk"}            KV tier blocks, hits, bytes, loads (with a tier)
    pagedkv_kv_offload_preemptions_total{mode}       recompute | swap (with a tier)
    pagedkv_kv_offload_{swaps,swapped_blocks}_total{direction="out|in"}, _swap_seconds_total
    pagedkv_spec_decode_{num_drafts,num_draft_tokens,num_accepted_tokens}_total,
    pagedkv_spec_decode_num_accepted_tokens_per_pos_total{position}   (speculative decoding on)
    pagedkv_requests_rejected_total{reason}          never_fits (engine) | invalid | out_of_vocabulary | unauthorized
    pagedkv_requests_finished_total{finish_reason}   stop | length | abort
    pagedkv_{prompt,prompt_cached,generation}_tokens_total
    pagedkv_time_to_first_token_seconds, _time_per_output_token_seconds,
    pagedkv_e2e_request_latency_seconds              histograms (engine arrival -> token)
    pagedkv_step_num_requests                        requests that got a token, per engine step
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _StatsCollector:
    """Gauges and engine counters from the latest EngineStats snapshot."""

    def __init__(self, get_stats: Callable[[], EngineStats], rejected: Callable[[], dict[str, int]]) -> None:
        self.get_stats, self.rejected = get_stats, rejected

    def collect(self):
        s = self.get_stats()
        blocks = GaugeMetricFamily("pagedkv_kv_blocks", "KV cache blocks by state", labels=["state"])
        for state, v in (("used", s.blocks_used), ("cached", s.blocks_cached), ("free", s.blocks_free)):
            blocks.add_metric([state], v)
        yield blocks
        yield GaugeMetricFamily("pagedkv_kv_blocks_total", "KV cache blocks in the pool", value=s.num_blocks)
        yield GaugeMetricFamily("pagedkv_kv_block_size_tokens", "tokens per KV block", value=s.block_size)
        yield GaugeMetricFamily("pagedkv_kv_cache_usage_ratio", "used / total KV blocks (cached count as free)",
                                value=s.kv_usage)
        yield GaugeMetricFamily("pagedkv_num_requests_running", "requests running", value=s.num_running)
        yield GaugeMetricFamily("pagedkv_num_requests_waiting", "requests waiting", value=s.num_waiting)
        yield CounterMetricFamily("pagedkv_prefix_cache_queries_tokens", "prompt tokens looked up in the "
                                  "prefix cache", value=s.prefix_cache_queries)
        yield CounterMetricFamily("pagedkv_prefix_cache_hits_tokens", "prompt tokens found in the prefix cache",
                                  value=s.prefix_cache_hits)
        yield CounterMetricFamily("pagedkv_num_preemptions", "preemptions (recompute or swap)",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("pagedkv_kv_blocks_freed_by_window", "KV blocks a sliding window gave back "
                                  "before their request ended", value=s.blocks_freed_by_window)
        yield CounterMetricFamily("pagedkv_kv_tokens_evicted", "tokens score-based KV eviction (snapkv) dropped "
                                  "from requests' caches", value=s.tokens_evicted)
        yield CounterMetricFamily("pagedkv_kv_blocks_freed_by_eviction", "KV blocks score-based eviction's "
                                  "compactions gave back", value=s.blocks_freed_by_eviction)
        yield from _offload_metrics(s.kv_offload)
        yield from _swap_metrics(s.kv_offload, s.preemptions_by_mode)
        yield from _spec_metrics(s.spec_decode)
        yield from _transfer_metrics(s.kv_transfer)
        yield CounterMetricFamily("pagedkv_generation_tokens", "tokens generated", value=s.num_generated_tokens)
        rej = CounterMetricFamily("pagedkv_requests_rejected", "requests rejected", labels=["reason"])
        rej.add_metric(["never_fits"], s.num_rejected)
        for reason, v in self.rejected().items():
            rej.add_metric([reason], v)
        yield rej


_OFFLOAD_COUNTERS = (  # metric name, help, key per tier (cpu, disk)
    ("hit_tokens", "prompt tokens loaded from the tier", "hit_tokens", "disk_hit_tokens"),
    ("blocks_loaded", "blocks copied tier -> cache", "blocks_loaded", "disk_blocks_loaded"),
    ("blocks_saved", "blocks written to the tier", "blocks_saved", "disk_blocks_written"),
    ("read_bytes", "bytes read from the tier", "bytes_read", "disk_bytes_read"),
    ("written_bytes", "bytes written to the tier", "bytes_written", None),
    ("load_seconds", "seconds spent loading from the tiers before forwards", "load_seconds", None),
    ("evictions", "tier blocks evicted", "evictions", None),
    ("corrupt_records", "records that failed a check (a miss)", None, "disk_corrupt_records"),
)


def _offload_metrics(o: dict | None):
    """``pagedkv_kv_offload_*`` of the CPU tier and, if configured, the disk tier."""
    if not o:
        return
    tiers = [("cpu", 0)] + ([("disk", 1)] if o.get("disk_capacity_blocks") else [])
    blocks = GaugeMetricFamily("pagedkv_kv_offload_blocks", "KV tier blocks", labels=["tier", "state"])
    for tier, _ in tiers:
        prefix = "" if tier == "cpu" else "disk_"
        blocks.add_metric([tier, "used"], o[prefix + "blocks_used"])
        blocks.add_metric([tier, "capacity"], o[prefix + "capacity_blocks"])
    yield blocks
    for name, help_text, *keys in _OFFLOAD_COUNTERS:
        c = CounterMetricFamily(f"pagedkv_kv_offload_{name}", help_text, labels=["tier"])
        for tier, i in tiers:
            if keys[i] is not None:
                c.add_metric([tier], o[keys[i]])
        if c.samples:  # a disk-only counter without a disk tier has none
            yield c


def _swap_metrics(o: dict | None, by_mode: dict | None):
    """``pagedkv_kv_offload_{preemptions,swaps,swapped_blocks,swap_seconds}_total`` with a CPU tier."""
    if not o:
        return
    pre = CounterMetricFamily("pagedkv_kv_offload_preemptions", "preemptions by mode", labels=["mode"])
    for mode, n in (by_mode or {}).items():
        pre.add_metric([mode], n)
    yield pre
    for name, help_text, keys in (("swaps", "requests swapped to / from the CPU tier", ("swap_outs", "swap_ins")),
                                  ("swapped_blocks", "blocks copied by swap preemption (out: copied, not "
                                   "pinned tier blocks; in: every block brought back)",
                                   ("swap_blocks_out", "swap_blocks_in"))):
        c = CounterMetricFamily(f"pagedkv_kv_offload_{name}", help_text, labels=["direction"])
        c.add_metric(["out"], o[keys[0]])
        c.add_metric(["in"], o[keys[1]])
        yield c
    yield CounterMetricFamily("pagedkv_kv_offload_swap_seconds", "seconds spent copying swapped blocks",
                              value=o["swap_seconds"])


def _spec_metrics(d: dict | None):
    """``pagedkv_spec_decode_*``, vLLM's ``vllm:spec_decode_*`` counters, with speculative decoding on."""
    if not d:
        return
    for name, help_text in (("num_drafts", "verification steps of a request with drafts"),
                            ("num_draft_tokens", "draft tokens verified"),
                            ("num_accepted_tokens", "draft tokens accepted")):
        yield CounterMetricFamily(f"pagedkv_spec_decode_{name}", help_text, value=d[name])
    per_pos = CounterMetricFamily("pagedkv_spec_decode_num_accepted_tokens_per_pos",
                                  "draft tokens accepted at each position of a draft", labels=["position"])
    for i, n in enumerate(d["num_accepted_tokens_per_pos"]):
        per_pos.add_metric([str(i)], n)
    yield per_pos


def _transfer_metrics(t: dict | None):
    """``pagedkv_kv_transfer_*``: a prefill (producer) or decode (consumer) instance's KV
    link, with ``--kv-transfer-config``."""
    if not t:
        return
    role = [t["role"]]
    for name, help_text, kind in (("link_up", "1 while the KV link to the peer is up", GaugeMetricFamily),
                                  ("leases", "finished prompts whose pages wait to be pulled", GaugeMetricFamily),
                                  ("blocks", "KV blocks transferred", CounterMetricFamily),
                                  ("bytes", "KV bytes transferred", CounterMetricFamily),
                                  ("seconds", "seconds spent in transfers", CounterMetricFamily)):
        m = kind(f"pagedkv_kv_transfer_{name}", help_text, labels=["role"])
        m.add_metric(role, float(t[name]))
        yield m
    pulls = CounterMetricFamily("pagedkv_kv_transfer_pulls", "pulls by outcome", labels=["role", "outcome"])
    for outcome in ("ok", "failed"):
        pulls.add_metric(role + [outcome], t["pulls_" + outcome])
    yield pulls
    if "leases_reclaimed" in t:  # producer
        m = CounterMetricFamily("pagedkv_kv_transfer_leases_reclaimed", "leases ended early because a waiting "
                                "request needed their pages (their decode legs compute those prompts)",
                                labels=["role"])
        m.add_metric(role, float(t["leases_reclaimed"]))
        yield m
    outcomes = {"sent": "pushes", "given_up": "pushes_given_up", "received": "pushes_received",
                "late": "pushes_late", "dropped": "pushes_dropped", "hit": "push_hits", "miss": "push_misses"}
    if any(key in t for key in outcomes.values()):  # kv_send_type PUT_ASYNC (producer), any consumer
        pushes = CounterMetricFamily("pagedkv_kv_transfer_pushes", "producer: layer pushes sent, transfers that "
                                     "stopped pushing (given_up); consumer: pushes received, thrown away after their "
                                     "transfer ended (late), transfers dropped, "
                                     "transfers taken from the push buffer (hit) or not (miss)",
                                     labels=["role", "outcome"])
        for outcome, key in outcomes.items():
            if key in t:
                pushes.add_metric(role + [outcome], t[key])
        yield pushes


class ServerMetrics:
    """The app's registry. ``observe`` runs on the engine thread; ``render`` on the HTTP side."""

    def __init__(self, get_stats: Callable[[], EngineStats]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=False)
        self._rejected: dict[str, int] = {"invalid": 0, "out_of_vocabulary": 0, "unauthorized": 0}
        self._lock = threading.Lock()
        self._started: set[str] = set()   # requests whose prompt tokens are counted
        r.register(_StatsCollector(get_stats, self._rejected_snapshot))
        self.prompt_tokens = Counter("pagedkv_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.cached_tokens = Counter("pagedkv_prompt_cached_tokens", "prompt tokens not computed: found in the "
                                     "prefix cache, a KV tier, or transferred from a prefill instance", registry=r)
        self.finished = Counter("pagedkv_requests_finished", "requests finished", ["finish_reason"], registry=r)
        self.ttft = Histogram("pagedkv_time_to_first_token_seconds", "arrival -> first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pagedkv_time_per_output_token_seconds", "mean time per output token after the "
                              "first", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pagedkv_e2e_request_latency_seconds", "arrival -> last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.batch = Histogram("pagedkv_step_num_requests", "requests that got a token in one engine step",
                               buckets=BATCH_BUCKETS, registry=r)

    def reject(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def _rejected_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._rejected)

    def observe(self, outputs: list[RequestOutput]) -> None:
        """One batch of outputs from the engine thread (a step's, or aborts')."""
        produced = 0
        for o in outputs:
            if o.token_ids and o.request_id not in self._started:
                self._started.add(o.request_id)
                self.prompt_tokens.inc(o.num_prompt_tokens)
                self.cached_tokens.inc(o.num_cached_tokens)
            if o.finish_reason != "abort":
                produced += 1
            if o.finished:
                self._finish(o)
        if produced:
            self.batch.observe(produced)

    def _finish(self, o: RequestOutput) -> None:
        self._started.discard(o.request_id)
        self.finished.labels(o.finish_reason or "unknown").inc()
        if o.ttft is not None:
            self.ttft.observe(o.ttft)
            self.e2e.observe(o.e2e)
            if len(o.token_ids) > 1:
                self.tpot.observe(o.tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
