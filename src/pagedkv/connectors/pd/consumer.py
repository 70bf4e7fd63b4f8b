"""The decode instance's KV connector: a prompt's pages pulled from the prefill instance.

A request whose ``kv_transfer_params`` say ``do_remote_prefill`` (with the proxy's
``transfer_id``) is offered its prompt's KV beyond the local prefix hit: the scheduler
allocates pages for it as for a hit, and before the step's forward the worker pulls the
producer's pages for those blocks only (blocks this instance had cached are not sent),
checks their checksums, writes them in, and releases the producer's lease. The last prompt
token is always computed here, so the first output token comes from this instance's own
forward. A pull that fails (no link, an unknown or mismatched lease, a timeout, a bad
checksum) marks the pages as failed: under ``recompute`` the scheduler computes those
tokens here (correct, slower); under ``fail`` the request ends with the reason.
A request is offered the transfer once: after a preemption it computes its prompt here.

Pages the producer pushed (``kv_send_type`` ``PUT_ASYNC``: :mod:`~pagedkv.connectors.pd.push`)
wait in a buffer of ``kv_buffer_size`` bytes; a pull finds them there first (waiting, within
its timeout, for the last layers still on the wire) and asks the producer only when they are
not all there.
"""

from __future__ import annotations

import itertools
import logging
import time

from pagedkv.config.kv_transfer import KVTransferConfig
from pagedkv.connectors.base import KVConnector, KVConnectorScheduler, KVConnectorWorker
from pagedkv.connectors.pd.chunks import ChunkReceiver, plan_chunks
from pagedkv.connectors.pd.kv_link import REQUEST_TAG, KVLink, LinkError
from pagedkv.connectors.pd.pages import PageLayout, tokens_hash
from pagedkv.connectors.pd.push import FIRST_PUSH_GRACE_S, LayerPages
from pagedkv.connectors.pd.push_buffer import PushBuffer, apply_pushed

log = logging.getLogger("pagedkv.kv_transfer")


class ConsumerScheduler(KVConnectorScheduler):
    def __init__(self, cfg: KVTransferConfig, block_size: int, link: KVLink) -> None:
        self.block_size, self.link = block_size, link
        self.load_failure_policy = cfg.kv_load_failure_policy
        self.offered: set[str] = set()  # requests offered the transfer (once each)
        self.local: dict[str, int] = {}  # their local hit, in tokens
        self.pulls: dict[str, dict] = {}  # this step's pulls, by request id
        self.releases: list[str] = []  # transfer ids to release without a pull

    @staticmethod
    def _params(request) -> dict | None:
        p = request.sampling_params.kv_transfer_params
        return p if p and p.get("do_remote_prefill") and p.get("transfer_id") else None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        if self._params(request) is None or request.request_id in self.offered:
            return 0
        self.local[request.request_id] = num_computed_tokens
        return max(0, request.num_prompt_tokens - num_computed_tokens) if self.link.ready.is_set() else 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        p, rid = self._params(request), request.request_id
        if p is None or rid in self.offered:
            return
        self.offered.add(rid)
        local = self.local.pop(rid, 0)
        if num_external_tokens <= 0:  # nothing to pull (a local hit, a one-token prompt, no link)
            self.releases.append(str(p["transfer_id"]))
            return
        bs, end = self.block_size, local + num_external_tokens
        first, last = local // bs, (end + bs - 1) // bs
        self.pulls[rid] = {"transfer_id": str(p["transfer_id"]), "first_block": first, "num_blocks": last - first,
                           "num_tokens": end, "tokens_hash": tokens_hash(request.all_token_ids[:end]),
                           "dst": list(block_ids[0][first:last]), "num_prompt_tokens": request.num_prompt_tokens,
                           "prompt_hash": tokens_hash(request.all_token_ids[:request.num_prompt_tokens])}

    def reject(self, params: dict | None) -> None:
        """A request this instance refused at once (it never reaches the scheduler): let the
        producer free its lease now, not when it runs out."""
        if params and params.get("do_remote_prefill") and params.get("transfer_id"):
            self.releases.append(str(params["transfer_id"]))

    def has_pending_releases(self) -> bool:
        return bool(self.releases)

    def request_finished(self, request, block_ids) -> bool:
        p = self._params(request)
        if p is not None and request.request_id not in self.offered:  # never scheduled: let the producer free now
            self.releases.append(str(p["transfer_id"]))
        self.offered.discard(request.request_id)
        self.local.pop(request.request_id, None)
        self.pulls.pop(request.request_id, None)
        return False

    def build_connector_meta(self, scheduler_output) -> object | None:
        scheduled = set(scheduler_output.num_scheduled_tokens)
        pulls = [dict(v, req_id=k) for k, v in self.pulls.items() if k in scheduled]
        for pull in pulls:
            del self.pulls[pull["req_id"]]
        releases, self.releases = self.releases, []
        return {"pulls": pulls, "releases": releases}


class ConsumerWorker(KVConnectorWorker):
    def __init__(self, cfg: KVTransferConfig, link: KVLink, pushed: PushBuffer) -> None:
        self.cfg, self.link, self.pushed = cfg, link, pushed
        self.push_pages: LayerPages | None = None
        self._step_pushes: dict[str, object] = {}
        self._first_push_by = 0.0  # this step's legs wait for a first push until then (one grace a step)
        self.metadata, self.errors = None, set()
        self.rx: ChunkReceiver | None = None  # the storage's page layout and staging buffers, reused
        self.seq = itertools.count(16, 2)  # answer tags (even; data on the next): 0 carries requests, 1 the handshake
        self.num_pulls = self.num_pulled_blocks = self.num_failed_pulls = 0
        self.pulled_bytes, self.pull_seconds = 0, 0.0

    def bind_connector_metadata(self, metadata) -> None:
        self.metadata, self.errors = metadata, set()

    def start_load_kv(self, storage) -> None:
        """This step's pulls, then one release per transfer (several choices of one prompt
        pull the same lease in the same step before it is released)."""
        meta = self.metadata or {}
        done = list(meta.get("releases", ()))
        self.pushed.expire()
        self._first_push_by = time.monotonic() + (FIRST_PUSH_GRACE_S if self.link.peer_pushes else 0.0)
        self._step_pushes = {}  # transfer id -> its pushes, for every choice of a prompt
        for pull in meta.get("pulls", ()):
            try:
                self._pull(storage, pull)
            except Exception as e:  # noqa: BLE001 - a failed pull fails its pages, never the step
                self.errors.update(pull["dst"])
                self.num_failed_pulls += 1
                if not isinstance(e, (LinkError, ValueError)):
                    log.exception("KV pull of %s failed", pull["req_id"])
                log.warning("KV pull of %s failed (%s): the prompt is computed here" if
                            self.cfg.kv_load_failure_policy == "recompute" else "KV pull of %s failed (%s)",
                            pull["req_id"], e)
            done.append(pull["transfer_id"])
        for entry in self._step_pushes.values():
            self.pushed.recycle(entry)
        self._step_pushes = {}
        for tid in dict.fromkeys(done):
            self.pushed.release(tid)
            self._release(tid)

    def _pull(self, storage, pull: dict) -> None:
        """Ask for the pages (in the order and chunks of :func:`plan_chunks`), take the
        status, then the chunks (each checked, then stored), all within ``kv_timeout_s``."""
        t0, seq = time.perf_counter(), next(self.seq)
        if self._from_pushes(storage, pull, time.monotonic() + self.cfg.kv_timeout_s / 2):
            self.pull_seconds += time.perf_counter() - t0
            return
        deadline = time.monotonic() + self.cfg.kv_timeout_s
        if self.rx is None or self.rx.layout.tensors[0].data_ptr() != storage.page_tensors(0)[0].data_ptr():
            self.rx = ChunkReceiver(PageLayout(storage))
        order, chunks = plan_chunks(pull["dst"], self.rx.layout)
        ask = {k: pull[k] for k in ("transfer_id", "first_block", "num_blocks", "num_tokens", "tokens_hash")}
        self.link.send(REQUEST_TAG, {"op": "pull", "seq": seq, **ask, "order": order, "chunks": chunks})
        meta, _ = self.link.recv(seq, deadline=deadline)
        if meta.get("status") != "ok":
            raise LinkError(f"the prefill instance has no such KV ({meta.get('status')}: released, expired, "
                            "or another prompt)")
        self.rx.post(self.link, seq, chunks, [pull["dst"][k] for k in order])
        if self.rx.take(deadline):
            raise LinkError("the transferred KV failed its checksum")
        self.num_pulls += 1
        self.num_pulled_blocks += len(pull["dst"])
        self.pulled_bytes += len(pull["dst"]) * self.rx.layout.page_bytes
        self.pull_seconds += time.perf_counter() - t0

    def _from_pushes(self, storage, pull: dict, deadline: float) -> bool:
        """Whether the pages came from the producer's pushes (then they are in place): waits
        for them until ``deadline`` (half the pull's timeout: the pull, if needed, gets its own)."""
        tid, first = pull["transfer_id"], pull["transfer_id"] not in self._step_pushes
        if first:  # (the n choices of a prompt share its transfer: taken once, copied for each)
            self._step_pushes[tid] = self.pushed.take(tid, deadline, self.link.ready.is_set, self._first_push_by)
        entry = self._step_pushes[tid]
        if entry is not None:
            base = storage.page_tensors(0)[0].data_ptr()
            if self.push_pages is None or self.push_pages.layers[0][0].data_ptr() != base:
                self.push_pages = LayerPages(storage)
        hit = entry is not None and apply_pushed(entry, self.push_pages, pull)
        if first and (entry is not None or self.link.peer_pushes):  # a pushing producer's transfer
            self.pushed.counts["push_hits" if hit else "push_misses"] += 1
        if hit:
            self.num_pulled_blocks += len(pull["dst"])
            self.pulled_bytes += len(pull["dst"]) * sum(self.push_pages.page_bytes)
        return hit

    def _release(self, transfer_id: str) -> None:
        try:
            self.link.send(REQUEST_TAG, {"op": "release", "transfer_id": transfer_id})
        except LinkError:
            pass  # no link: the producer's lease frees the pages

    def transfer_stats(self) -> dict:
        """Pulls done (ok / failed), blocks and bytes loaded and seconds spent loading them
        (the engine step waits for them; pushed pages included), whether the link is up; the
        push buffer's counts (pushes received and dropped, transfers taken from it or not)."""
        return {"role": "consumer", "link_up": self.link.ready.is_set(), "leases": 0,
                "pulls_ok": self.num_pulls, "pulls_failed": self.num_failed_pulls, "blocks": self.num_pulled_blocks,
                "bytes": self.pulled_bytes, "seconds": self.pull_seconds, **self.pushed.counts,
                "push_buffer_bytes": self.pushed.nbytes}

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.errors)

    def close(self) -> None:
        self.link.close()
        self.pushed.clear()


def consumer_connector(cfg: KVTransferConfig, block_size: int, fingerprint: str,
                       layout: dict | None = None) -> KVConnector:
    pushed = PushBuffer(int(cfg.kv_buffer_size), cfg.kv_lease_s)
    link = KVLink(cfg, fingerprint, layout=layout, on_push=pushed.receive, push_alloc=pushed.alloc,
                  on_heartbeat=pushed.expire).start()
    return KVConnector(ConsumerScheduler(cfg, block_size, link), ConsumerWorker(cfg, link, pushed))
