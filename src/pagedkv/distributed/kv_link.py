"""KVLink: the prefill instance's and the decode instance's two-rank gloo group.

torch.distributed's gloo backend (``ProcessGroupGloo`` over a ``TCPStore``), its own group
beside any tensor-parallel one. The producer (rank 0) hosts the store on ``kv_ip:kv_port``;
the consumer (rank 1) connects, reads the store's current *generation* and both build that
generation's group. A message is a header (two int64: JSON bytes, data bytes), JSON, then raw
data, all on one tag: the consumer's requests on tag 0, each answer on the request's own
sequence number, so an answer that comes too late is never taken for another's.

A link that fails (a peer that dies closes its sockets; one that does not answer in
``kv_timeout_s``) is dropped and built again in the background: the producer opens the next
generation and waits for a consumer; the consumer retries every second. Peers whose pages
would mean something else (:func:`~pagedkv.distributed.pages.fingerprint`) are refused at the
handshake. Trusted networks only, as vLLM's connectors: the port accepts any consumer.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import torch
import torch.distributed as dist

from pagedkv.distributed.kv_transfer_config import KVTransferConfig

log = logging.getLogger("pagedkv.kv_link")
IDLE = datetime.timedelta(days=1)  # the producer waits this long for the next request
REQUEST_TAG = 0


class LinkError(RuntimeError):
    """The link failed, or a peer did not answer in time."""


class KVLink:
    """One end of the link; ``start()`` connects in a daemon thread (and reconnects)."""

    def __init__(self, cfg: KVTransferConfig, fingerprint: str, on_request=None, on_lost=None) -> None:
        self.cfg, self.fingerprint = cfg, fingerprint
        self.rank = 0 if cfg.is_producer else 1
        self.timeout = datetime.timedelta(seconds=cfg.kv_timeout_s)
        self.on_request, self.on_lost = on_request, on_lost  # producer: handle a request; both: the peer is gone
        self.pg = None
        self.connected = threading.Event()
        self.refused: str | None = None  # a peer with other pages: never retried
        self.generation = 0
        self.closed = False
        self._late: list = []  # answers given up on, kept until the group is rebuilt

    def start(self) -> "KVLink":
        threading.Thread(target=self._run, name=f"pagedkv-kv-link-{self.cfg.kv_role}", daemon=True).start()
        return self

    def close(self) -> None:
        """Stop: the group is aborted, so a thread blocked on it returns (idempotent)."""
        self.closed = True
        self.connected.clear()
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - closing anyway
                pass

    # ---- messages ---------------------------------------------------------------------
    def send(self, tag: int, meta: dict, data: torch.Tensor | None = None) -> None:
        """Send one message; waits at most ``kv_timeout_s`` for the peer to take it."""
        pg = self._pg()
        body = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        n = 0 if data is None else data.numel()
        parts = [torch.tensor([body.numel(), n], dtype=torch.int64), body] + ([data] if n else [])
        try:
            for t in parts:
                pg.send([t], 1 - self.rank, tag).wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(e) from None

    def send_raw(self, tag: int, t: torch.Tensor) -> None:
        """Send one tensor as it is (the receiver knows its size)."""
        pg = self._pg()
        try:
            pg.send([t], 1 - self.rank, tag).wait(self.timeout)
        except RuntimeError as e:
            raise self._lost(e) from None

    def recv_raw(self, tag: int, t: torch.Tensor) -> None:
        """Receive one tensor of a known size into ``t``, within ``kv_timeout_s``."""
        self._wait(self._pg().recv([t], 1 - self.rank, tag), self.timeout)

    def recv(self, tag: int, timeout: datetime.timedelta | None = None) -> tuple[dict, torch.Tensor | None]:
        """Receive one message on ``tag``, each part within ``timeout`` (default ``kv_timeout_s``)."""
        pg, timeout = self._pg(), timeout or self.timeout
        head = torch.zeros(2, dtype=torch.int64)
        self._wait(pg.recv([head], 1 - self.rank, tag), timeout)
        body = torch.empty(int(head[0]), dtype=torch.uint8)
        self._wait(pg.recv([body], 1 - self.rank, tag), timeout)
        data = None
        if int(head[1]):
            data = torch.empty(int(head[1]), dtype=torch.uint8)
            self._wait(pg.recv([data], 1 - self.rank, tag), timeout)
        return json.loads(body.numpy().tobytes()), data

    def _wait(self, work, timeout) -> None:
        try:
            work.wait(timeout)
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                self._late.append(work)  # its buffer may still be written: keep it alive
                raise LinkError(f"the peer did not answer within {timeout.total_seconds():g} s") from None
            raise self._lost(e) from None

    def _pg(self):
        pg = self.pg
        if pg is None or not self.connected.is_set():
            raise LinkError(self.refused or "not connected to the "
                            + ("decode instance" if self.rank == 0 else "prefill instance"))
        return pg

    def _lost(self, e: BaseException) -> LinkError:
        """The peer is gone: drop the group (the background thread builds the next)."""
        if self.connected.is_set():
            log.warning("KV link to the peer lost: %s", str(e).splitlines()[0])
            self.connected.clear()
            if self.on_lost is not None:
                self.on_lost()
        return LinkError(f"the link to the peer failed: {str(e).splitlines()[0]}")

    # ---- connecting ---------------------------------------------------------------------
    def _run(self) -> None:
        store = None
        while not self.closed and self.refused is None:
            try:
                store = store or self._store()
                self._connect(store)
                self._serve() if self.rank == 0 else self._idle()
            except Exception as e:  # noqa: BLE001 - log, wait, try again
                if self.connected.is_set():
                    self._lost(e)
                if self.rank == 1:
                    store = None  # the producer may have restarted: a new store
                time.sleep(1.0)

    def _store(self):
        return dist.TCPStore(self.cfg.kv_ip, self.cfg.kv_port, None, self.rank == 0,
                             timeout=datetime.timedelta(seconds=self.cfg.kv_timeout_s), wait_for_workers=False)

    def _connect(self, store) -> None:
        if self.rank == 0:
            self.generation += 1
            store.set("generation", str(self.generation))
        else:
            self.generation = int(store.get("generation"))
        self._late = []
        prefix = dist.PrefixStore(f"kv-link-{self.generation}", store)
        # the producer waits for a consumer as long as it takes; a consumer gives up after kv_timeout_s
        self.pg = dist.ProcessGroupGloo(prefix, self.rank, 2, IDLE if self.rank == 0 else self.timeout)
        self.connected.set()
        if self.rank == 1:  # the handshake: the same pages on both ends, or no link
            self.send(REQUEST_TAG, {"op": "hello", "fingerprint": self.fingerprint})
            meta, _ = self.recv(1)
            if not meta.get("ok"):
                self.refused = ("the prefill instance's KV pages differ from this instance's (model, weights, dtypes, "
                                "block size or scales): no KV is transferred")
                self.connected.clear()
                log.error("KV link refused: %s", self.refused)

    def _serve(self) -> None:
        """Producer: answer requests until the link fails."""
        while self.connected.is_set() and not self.closed:
            meta, _ = self.recv(REQUEST_TAG, IDLE)
            if meta.get("op") == "hello":
                ok = meta.get("fingerprint") == self.fingerprint
                if not ok:
                    log.error("KV link: a consumer with other KV pages connected; refused")
                self.send(1, {"ok": ok})
            elif self.on_request is not None:
                self.on_request(self, meta)

    def _idle(self) -> None:
        """Consumer: the engine thread uses the link; wait here until it fails."""
        while self.connected.is_set() and not self.closed:
            time.sleep(0.2)
