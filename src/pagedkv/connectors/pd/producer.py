"""The prefill instance's KV connector: finished prompts' pages kept under a lease.

A request whose ``kv_transfer_params`` say ``do_remote_decode`` (with the proxy's
``transfer_id``) keeps its pages when it ends normally: the scheduler's delayed free, held
by a lease of ``kv_lease_s`` seconds. The consumer pulls them over the :class:`KVLink`
(the lease's token ids must match its prompt's) and then releases them; a lease that ends
unreleased, a lost link, or a request aborted here frees them too. So every page comes back
within ``kv_lease_s`` (plus one step) whatever the consumer does. A lease is a promise of
speed, not of memory: when a waiting request cannot get pages, leases older than
``RECLAIM_AFTER_S`` end early, oldest first (``RECLAIM_IDLE_S`` when nothing else runs:
then waiting only idles the engine; their consumers compute those prompts themselves), so
a request of many prompts, whose decode leg starts only after its last prefill, cannot
hold the pool until its own leases expire.

With ``kv_send_type`` ``PUT_ASYNC`` the pages are also pushed layer by layer while the prompt
computes (:mod:`~pagedkv.connectors.pd.push`); the lease and the pull stay as they are, the
fallback for whatever the consumer did not get that way.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from pagedkv.config.kv_transfer import KVTransferConfig
from pagedkv.connectors.base import KVConnector, KVConnectorScheduler, KVConnectorWorker
from pagedkv.connectors.pd.chunks import ChunkSender, valid_plan
from pagedkv.connectors.pd.kv_link import KVLink, LinkError
from pagedkv.connectors.pd.pages import PageLayout, tokens_hash
from pagedkv.connectors.pd.push import LayerPages, PushSender

log = logging.getLogger("pagedkv.kv_transfer")
IDLE_WAIT_S = 0.05  # an idle engine step waits this long for a lease to end (no busy loop)
RECLAIM_AFTER_S = 0.5  # a lease this old ends early when a waiting request needs its pages
RECLAIM_IDLE_S = 0.05  # ... and this old when nothing else runs (a decode leg's pull comes within ms)


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    token_ids: list[int]  # the tokens whose KV the pages hold
    expires: float
    fault: str | None = None
    busy: bool = False  # pages being sent: the lease does not end under the copy


@dataclass
class LeaseTable:
    """Leases by transfer id; shared by the engine thread and the link's thread."""
    lease_s: float
    leases: dict[str, Lease] = field(default_factory=dict)
    ended: list[str] = field(default_factory=list)  # request ids whose pages may be freed
    lock: threading.Condition = field(default_factory=threading.Condition)
    reclaimed: int = 0  # leases ended early for a waiting request's pages

    def reclaim(self, num_blocks: int, min_age_s: float = RECLAIM_AFTER_S) -> int:
        """End leases at least ``min_age_s`` old, oldest first, until they held about
        ``num_blocks`` pages; returns how many ended. None while ended leases' pages wait to
        be freed (the scheduler sees them next step, then asks again if still short)."""
        with self.lock:
            if self.ended:
                return 0
            latest = time.monotonic() + self.lease_s - min_age_s  # expiry of a lease min_age_s old
            old = sorted((x.expires, tid) for tid, x in self.leases.items() if not x.busy and x.expires <= latest)
            freed = ended = 0
            for _, tid in old:
                if freed >= num_blocks:
                    break
                freed += len(self.leases[tid].block_ids)
                self.end(tid)
                ended += 1
            self.reclaimed += ended
            return ended

    def add(self, transfer_id: str, lease: Lease) -> bool:
        with self.lock:
            if transfer_id in self.leases:
                return False  # a transfer id in use: these pages are freed at once
            self.leases[transfer_id] = lease
            return True

    def end(self, transfer_id: str) -> None:
        """End a lease (its pages may be freed), unless it is being sent (the link's own
        thread, which ends it after)."""
        with self.lock:
            lease = self.leases.get(transfer_id)
            if lease is not None and lease.busy:
                lease.expires = 0.0  # ends at the next check once the copy is done
                return
            lease = self.leases.pop(transfer_id, None)
            if lease is not None:
                self.ended.append(lease.request_id)
                self.lock.notify_all()

    def end_all(self) -> None:
        with self.lock:
            for tid in list(self.leases):
                self.end(tid)

    def take_ended(self, wait_s: float) -> set[str]:
        """Request ids whose leases ended (released, expired), waiting up to ``wait_s`` for one."""
        with self.lock:
            now = time.monotonic()
            for tid, lease in list(self.leases.items()):
                if lease.expires <= now and not lease.busy:
                    self.end(tid)
            if not self.ended and wait_s > 0 and self.leases:
                self.lock.wait(min(wait_s, max(0.0, min(x.expires for x in self.leases.values()) - now)))
            out, self.ended = set(self.ended), []
            return out


class ProducerScheduler(KVConnectorScheduler):
    """Leases at a prefill leg's end; with pushes on (``kv``: the engine's KV manager), each
    step's push jobs: per prefill leg scheduled, its pages from the block where this chunk
    starts (from block 0 when it is first or again scheduled: a prefix hit's pages too)."""

    def __init__(self, leases: LeaseTable, link: KVLink, kv=None, fault_injection: bool = False,
                 on_abandon=None) -> None:
        self.leases, self.link, self.kv_manager, self.fault_injection = leases, link, kv, fault_injection
        self.on_abandon = on_abandon  # a transfer id whose pushes stop unfinished (the worker tells the consumer)
        self.pushing: dict[str, dict] = {}  # prefill legs being pushed, by request id

    def request_finished(self, request, block_ids) -> bool:
        """Keep the pages of a finished prefill leg under a lease, when a consumer is linked
        (no consumer: nothing could pull them; it computes the prompt itself)."""
        st = self.pushing.pop(request.request_id, None)
        if st is not None:  # ended before its last chunk (aborted, a failed step): no done will come
            self.on_abandon(st["transfer_id"])
        p = request.sampling_params.kv_transfer_params or {}
        if not p.get("do_remote_decode") or request.finish_reason == "abort" or not request.num_computed_tokens:
            return False
        if not self.link.ready.is_set():
            return False
        n = request.num_computed_tokens
        lease = Lease(request.request_id, list(block_ids[0]), list(request.all_token_ids[:n]),
                      time.monotonic() + self.leases.lease_s, p.get("fault"))
        return self.leases.add(str(p["transfer_id"]), lease)

    def reclaim(self, num_blocks: int, idle: bool = False) -> None:
        if self.leases.reclaim(num_blocks, RECLAIM_IDLE_S if idle else RECLAIM_AFTER_S):
            log.info("KV leases ended early for a waiting request's pages (%d so far): their decode legs compute "
                     "those prompts", self.leases.reclaimed)

    def build_connector_meta(self, scheduler_output) -> object | None:
        meta = {"idle": not scheduler_output.num_scheduled_tokens}
        if self.kv_manager is not None:
            meta["pushes"] = self._pushes(scheduler_output)
        return meta

    def step_failed(self, scheduler_output) -> None:
        """A failed step's chunks may be half pushed, their done never sent: give them up."""
        for job in (scheduler_output.kv_connector_metadata or {}).get("pushes", ()):
            self.on_abandon(job["transfer_id"])

    def _in_use(self, tid: str, rid: str) -> bool:
        """Another request pushes under ``tid``, or holds a lease there (a reused transfer id:
        its pages are not pushed, and its lease is refused, so the consumer gets the first's)."""
        with self.leases.lock:
            if tid in self.leases.leases:
                return True
        return any(st["transfer_id"] == tid for r, st in self.pushing.items() if r != rid)

    def _pushes(self, out) -> list[dict]:
        for new in out.scheduled_new_reqs:
            p = new.sampling_params.kv_transfer_params or {}
            if p.get("do_remote_decode") and p.get("transfer_id") and self.link.ready.is_set() \
                    and not self._in_use(str(p["transfer_id"]), new.req_id):
                self.pushing[new.req_id] = {"transfer_id": str(p["transfer_id"]), "computed": new.num_computed_tokens,
                                            "start": 0, "prompt": new.token_ids[:new.num_prompt_tokens],
                                            "fault": p.get("fault") if self.fault_injection else None}
        jobs, bs = [], self.kv_manager.block_size
        for rid, n in out.num_scheduled_tokens.items():
            st = self.pushing.get(rid)
            if st is None:
                continue
            start, end = st.pop("start", st["computed"] // bs), st["computed"] + n
            last = -(-end // bs)
            job = {"transfer_id": st["transfer_id"],
                   "block_ids": list(self.kv_manager.get_block_ids(rid)[0][start:last]),
                   "first_block": start, "fault": st["fault"], "final": end >= len(st["prompt"])}
            st["computed"] = end
            if job["final"]:  # the prompt's last chunk: nothing after it is pushed
                job.update(num_tokens=end, tokens_hash=tokens_hash(st["prompt"][:end]), num_blocks=last)
                del self.pushing[rid]
            jobs.append(job)
        return jobs


class ProducerWorker(KVConnectorWorker):
    """Answers the consumer's pulls (in the link's thread) and reports ended leases."""

    def __init__(self, cfg: KVTransferConfig, leases: LeaseTable, storage, fingerprint: str,
                 block_size: int, layout: dict | None = None) -> None:
        self.cfg, self.leases, self.storage, self.block_size = cfg, leases, storage, block_size
        self.sender = ChunkSender(PageLayout(storage))
        self.counts = dict.fromkeys(("pulls_ok", "pulls_failed", "blocks", "bytes"), 0) | {"seconds": 0.0}
        self.link = KVLink(cfg, fingerprint, on_request=self._on_request, on_lost=leases.end_all, layout=layout)
        pushing = cfg.kv_send_type == "PUT_ASYNC"
        self.pusher = PushSender(self.link, LayerPages(storage), cfg.kv_lease_s) if pushing else None
        self.metadata = None

    def save_kv_layer(self, layer: int, storage, attn_metadata) -> None:
        for job in (self.metadata or {}).get("pushes", ()):
            self.pusher.layer_written(job, layer)

    def wait_for_save(self) -> None:
        """Nothing is waited for: the sender thread sends the step's copies meanwhile."""
        for job in (self.metadata or {}).get("pushes", ()):
            self.pusher.chunk_done(job)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        idle = bool(self.metadata and self.metadata.get("idle"))
        return self.leases.take_ended(IDLE_WAIT_S if idle else 0.0), set()

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
        self.link.close()

    def transfer_stats(self) -> dict:
        """Pulls answered (ok / failed, a fault or refusal included), blocks and bytes sent,
        seconds spent sending (pushes included), leases held now, whether a consumer is
        linked; with pushes, also layer pushes sent, their pages (once per chunk), bytes and
        seconds, and transfers that stopped pushing."""
        with self.leases.lock:
            held = len(self.leases.leases)
        out = {"role": "producer", "link_up": self.link.ready.is_set(), "leases": held,
               "leases_reclaimed": self.leases.reclaimed, **self.counts}
        if self.pusher is not None:  # blocks, bytes and seconds count the pushes too
            pushed = dict(self.pusher.counts)
            out.update(pushed, blocks=out["blocks"] + pushed["push_blocks"], bytes=out["bytes"] + pushed["push_bytes"],
                       seconds=out["seconds"] + pushed["push_seconds"])
        return out

    # ---- the link's thread --------------------------------------------------------------
    def _on_request(self, link: KVLink, meta: dict) -> None:
        if meta.get("op") == "release":
            self.leases.end(str(meta.get("transfer_id")))
        elif meta.get("op") == "pull":
            self._pull(link, meta)

    def _pull(self, link: KVLink, meta: dict) -> None:
        """Answer a pull: its status, then (``ok``) the pages in the consumer's order and
        chunks (:mod:`~pagedkv.connectors.pd.chunks`). The lease is marked busy meanwhile,
        so it cannot end under the send."""
        tid, seq = str(meta.get("transfer_id")), int(meta["seq"])
        first, count = int(meta["first_block"]), int(meta["num_blocks"])
        with self.leases.lock:
            lease = self.leases.leases.get(tid)
            fault = lease.fault if lease is not None and self.cfg.kv_fault_injection else None
            fault = None if fault == "corrupt_push" else fault  # (a fault of the push alone)
            status = self._check(lease, meta, first, count)
            if status == "ok" and fault in (None, "corrupt", "stall"):
                lease.busy = True
        t0, outcome = time.perf_counter(), "failed"
        try:
            if fault == "drop":
                return
            if fault == "delay":  # answer only once the lease has ended: the consumer finds it gone
                time.sleep(max(0.0, lease.expires - time.monotonic()) + 0.1)
                status = "unknown"
            if status != "ok":
                link.send(seq, {"status": status})
                return
            link.send(seq, {"status": "ok"})
            src = [lease.block_ids[first + k] for k in meta["order"]]
            self.sender.send(link, seq, src, meta["chunks"], fault)
            outcome = "ok"
            self.counts["blocks"] += len(src)
            self.counts["bytes"] += len(src) * self.sender.layout.page_bytes
            self.counts["seconds"] += time.perf_counter() - t0
        except LinkError:
            pass  # the consumer is gone: the lost link ends every lease
        finally:
            self.counts["pulls_" + outcome] += 1
            with self.leases.lock:
                if lease is not None:
                    lease.busy = False

    def _check(self, lease: Lease | None, meta: dict, first: int, count: int) -> str:
        """Serve only blocks of the tokens the consumer proved it holds (their hash)."""
        if lease is None:
            return "unknown"  # released, expired, or never here
        end, bs = int(meta["num_tokens"]), self.block_size
        if first < 0 or count < 1 or end > len(lease.token_ids) or first + count > min(len(lease.block_ids),
                                                                                      -(-end // bs)):
            return "out of range"
        if tokens_hash(lease.token_ids[:end]) != meta.get("tokens_hash"):
            return "prompt mismatch"
        if not valid_plan(meta.get("order"), meta.get("chunks"), count, self.sender.layout):
            return "bad chunk plan"
        return "ok"


def producer_connector(cfg: KVTransferConfig, storage, fingerprint: str, kv, layout: dict | None = None) -> KVConnector:
    """``kv``: the engine's KV cache manager (its block size; with pushes, its block tables)."""
    leases = LeaseTable(cfg.kv_lease_s)
    worker = ProducerWorker(cfg, leases, storage, fingerprint, kv.block_size, layout)
    scheduler = ProducerScheduler(leases, worker.link, kv if worker.pusher is not None else None,
                                  cfg.kv_fault_injection, worker.pusher.give_up if worker.pusher is not None else None)
    worker.link.start()
    return KVConnector(scheduler, worker)
