"""KVLink: the prefill instance's and the decode instance's two-rank gloo group.

torch.distributed's gloo backend (``ProcessGroupGloo`` over a ``TCPStore``), its own group
beside any tensor-parallel one. The producer (rank 0) hosts the store on ``kv_port`` (torch's
store listens on every interface; the pair itself binds to the address the host name
resolves to); the consumer (rank 1) connects to ``kv_ip:kv_port``, reads the store's current
*generation* and both build that generation's group. A message is a header (two int64: JSON
bytes, data bytes), JSON, then raw data, all on one tag and sent whole under a lock: the
consumer's requests on tag 0, each answer on the request's own sequence number, so an answer
that comes too late is never taken for another's. A pull's pages travel as raw tensors
posted without waiting (:meth:`isend_raw`, :meth:`irecv_raw`, then :meth:`wait`; see
:mod:`~pagedkv.connectors.pd.chunks`).

The link is *ready* once the handshake has passed: peers whose pages would mean something
else (:func:`~pagedkv.connectors.pd.pages.fingerprint`) are refused, and with a shared
secret (``kv_secret`` or ``$PAGEDKV_KV_SECRET``) each end proves it holds it before any page
moves: the producer puts a fresh nonce in the store for each generation, the consumer
answers with ``HMAC-SHA256(secret, "consumer:" nonce ":" fingerprint)`` and its own nonce,
which the producer answers in turn; a peer without it is refused with one log line. The consumer sends a
heartbeat every ``PING_S`` seconds; a producer that hears nothing for ``SILENT_S`` seconds
(a consumer that hung or lost its network) drops the link. A link that fails (a peer that
dies closes its sockets) is rebuilt in the background: the producer opens the next
generation, the consumer retries every second. The producer's store listens on ``kv_ip``
only (a socket bound there, handed to torch). Without a secret any process that reaches the
port can join as the consumer (a warning says so at start); the pages are never encrypted.
The secret keeps pages from a peer that does not hold it; it does not make the store port a
public one: a process that reaches it can still disturb the handshake (the producer restores
the generation key it finds changed, and reads a hello's size before its proof but takes at
most ``HELLO_BYTES``), so ``kv_ip`` should be reachable only from the pair's hosts.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time

import torch
import torch.distributed as dist

from pagedkv.config.kv_transfer import KVTransferConfig

log = logging.getLogger("pagedkv.kv_link")
REQUEST_TAG, HELLO_TAG, PUSH_TAG = 0, 1, 2  # (pulls' answers: even tags from 16, their data the odd one after)
PING_S = 2.0     # the consumer's heartbeat
SILENT_S = 10.0  # the producer drops a consumer it has not heard from for this long
JOIN_S = 5.0     # the producer waits this long for a consumer that said it joins, then opens the next generation
JOIN_POLL_S = 0.1  # how often the producer looks for a consumer's join
CONNECT_S = 3.0  # a consumer's attempt to reach the producer's store
FOREIGN_RETRY_S = 30.0  # a consumer's retry when kv_port answers as something else (each try logs torch's stacks)
MAX_META_BYTES = 16 << 20  # a message's JSON part at most (a pull's chunk plan for a long prompt is far less)
HELLO_BYTES = 64 << 10     # a hello's JSON at most, and no data: checked before the peer has proved anything


class LinkError(RuntimeError):
    """The link failed, or a peer did not answer in time."""


class ForeignPort(LinkError):
    """A consumer's ``kv_port`` accepts connections but is not a producer's store."""


class KVLink:
    """One end of the link; ``start()`` connects in a daemon thread (and reconnects)."""

    def __init__(self, cfg: KVTransferConfig, fingerprint: str, on_request=None, on_lost=None,
                 layout: dict | None = None, on_push=None, push_alloc=None, on_heartbeat=None) -> None:
        self.cfg, self.fingerprint, self.layout = cfg, fingerprint, layout or {}
        self.rank = 0 if cfg.is_producer else 1
        self.timeout = datetime.timedelta(seconds=cfg.kv_timeout_s)
        self.on_request, self.on_lost = on_request, on_lost  # producer: handle a request; both: the peer is gone
        self.on_push = on_push  # consumer: take a pushed message (meta, data); see pd_push
        self.push_alloc = push_alloc  # consumer: where a push's data is received (nbytes -> uint8 tensor)
        self.on_heartbeat = on_heartbeat  # consumer: called at each heartbeat (an idle engine's housekeeping)
        self.peer_pushes = False  # consumer: the producer said it pushes (kv_send_type PUT_ASYNC)
        self.pg = None
        self.ready = threading.Event()  # connected and the handshake passed
        self.refused: str | None = None  # a peer with other pages: never retried
        self.generation = 0
        self.closed = False
        self._stop = threading.Event()  # set by close(): wakes the thread's waits
        self._send_lock = threading.Lock()
        self._late: list = []  # answers given up on, kept until the group is rebuilt
        self._thread: threading.Thread | None = None
        self._last_error = ""

    def start(self) -> "KVLink":
        """Start the background thread; a producer first opens its store, so a port in use
        fails here (ValueError), not silently later."""
        self._store_obj = None
        if self.rank == 0 and self.cfg.secret is None:
            log.warning("KV link on %s:%d has no shared secret (kv_secret or $PAGEDKV_KV_SECRET): any process "
                        "that reaches the port can pull the KV of this instance's prompts", self.cfg.kv_ip,
                        self.cfg.kv_port)
        if self.rank == 0:
            try:
                self._store_obj = self._store()
            except Exception as e:  # noqa: BLE001 - torch raises several kinds
                raise ValueError(f"kv_transfer_config: cannot listen on kv_port {self.cfg.kv_port}: "
                                 f"{str(e).splitlines()[0]}") from None
        self._thread = threading.Thread(target=self._run, name=f"pagedkv-kv-link-{self.cfg.kv_role}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop: the group is aborted so a thread blocked on it returns, and the thread is
        joined (idempotent)."""
        self.closed = True
        self._stop.set()
        self.ready.clear()
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - closing anyway
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(JOIN_S + 1.0)  # (a consumer's store attempt takes at most CONNECT_S)

    # ---- messages ---------------------------------------------------------------------
    def send(self, tag: int, meta: dict, data: torch.Tensor | None = None) -> None:
        """Send one message whole; waits at most ``kv_timeout_s`` per part for the peer to take it."""
        self._send_parts(tag, self._message(meta, data))

    def isend_raw(self, tag: int, *tensors: torch.Tensor) -> list:
        """Post tensors for sending without waiting (the caller keeps them unchanged until
        :meth:`wait` on the returned works): a transfer prepares its next chunk meanwhile."""
        pg = self._pg()
        with self._send_lock:
            try:
                return [pg.send([t], 1 - self.rank, tag) for t in tensors]
            except RuntimeError as e:
                raise self._lost(e) from None

    def irecv_raw(self, tag: int, *tensors: torch.Tensor) -> list:
        """Post receives of known sizes into ``tensors`` without waiting (see :meth:`wait`)."""
        pg = self._pg()
        try:
            return [pg.recv([t], 1 - self.rank, tag) for t in tensors]
        except RuntimeError as e:
            raise self._lost(e) from None

    def wait(self, works: list, deadline: float | None = None) -> None:
        """Wait for posted sends or receives, each within ``kv_timeout_s`` and all by
        ``deadline`` (``time.monotonic()``) if given; on a failure the rest are kept (see
        :meth:`abandon`)."""
        for i, w in enumerate(works):
            try:
                self._wait(w, self.timeout, deadline)
            except LinkError:
                self.abandon(works[i + 1:])
                raise

    def reset(self, reason: str) -> None:
        """Drop the link now (its group aborted, so no posted receive writes anything later);
        the background thread builds the next generation."""
        self._lost(RuntimeError(reason))
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - dropping it anyway
                pass

    def abandon(self, works: list) -> None:
        """Posted works given up on: kept alive (their buffers may still be used) until the
        group is rebuilt."""
        self._late.extend(works)

    def _send_parts(self, tag: int, parts: list[torch.Tensor], pg=None) -> None:
        pg = pg or self._pg()
        with self._send_lock:
            try:
                for t in parts:
                    pg.send([t], 1 - self.rank, tag).wait(self.timeout)
            except RuntimeError as e:
                raise self._lost(e) from None

    def recv(self, tag: int, timeout: datetime.timedelta | None = None, pg=None,
             deadline: float | None = None, alloc=None, max_meta: int = MAX_META_BYTES,
             max_data: int | None = None) -> tuple[dict, torch.Tensor | None]:
        """Receive one message on ``tag``, each part within ``timeout`` (default
        ``kv_timeout_s``) and all by ``deadline`` (``time.monotonic()``) if given; its data
        into ``alloc(nbytes)`` (default: a new tensor). A header announcing more than
        ``max_meta`` JSON bytes or ``max_data`` data bytes drops the link (LinkError) before
        anything is allocated."""
        pg, timeout = pg or self._pg(), timeout or self.timeout
        head = torch.zeros(2, dtype=torch.int64)
        self._wait(pg.recv([head], 1 - self.rank, tag), timeout, deadline)
        n_meta, n_data = int(head[0]), int(head[1])
        if not 0 < n_meta <= max_meta or not 0 <= n_data <= (n_data if max_data is None else max_data):
            reason = f"a message announced {n_meta} JSON bytes and {n_data} data bytes"
            if pg is self.pg:  # the stream is out of step: this generation is over
                self.reset(reason)
            raise LinkError(f"the peer sent a malformed message: {reason}")
        body = torch.empty(n_meta, dtype=torch.uint8)
        self._wait(pg.recv([body], 1 - self.rank, tag), timeout, deadline)
        data = None
        if int(head[1]):
            data = (alloc or (lambda n: torch.empty(n, dtype=torch.uint8)))(int(head[1]))
            self._wait(pg.recv([data], 1 - self.rank, tag), timeout, deadline)
        return json.loads(body.numpy().tobytes()), data

    def _wait(self, work, timeout: datetime.timedelta, deadline: float | None = None) -> None:
        if deadline is not None:
            timeout = min(timeout, datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        try:
            work.wait(timeout)
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                self._late.append(work)  # its buffer may still be written: keep it alive
                raise LinkError(f"the peer did not answer within {self.cfg.kv_timeout_s:g} s"
                                if deadline is not None else
                                f"the peer did not answer within {timeout.total_seconds():g} s") from None
            raise self._lost(e) from None

    def _pg(self):
        pg = self.pg
        if pg is None or not self.ready.is_set():
            raise LinkError(self.refused or "not connected to the "
                            + ("decode instance" if self.rank == 0 else "prefill instance"))
        return pg

    def _lost(self, e: BaseException) -> LinkError:
        """The peer is gone: drop the group (the background thread builds the next)."""
        if self.ready.is_set():
            log.warning("KV link to the peer lost: %s", str(e).splitlines()[0])
            self.ready.clear()
            if self.on_lost is not None:
                self.on_lost()
        return LinkError(f"the link to the peer failed: {str(e).splitlines()[0]}")

    # ---- connecting ---------------------------------------------------------------------
    def _run(self) -> None:
        store = self._store_obj
        while not self.closed and self.refused is None:
            try:
                store = store or self._store()
                if self._connect(store):
                    self._serve() if self.rank == 0 else self._heartbeat()
            except Exception as e:  # noqa: BLE001 - say why once, wait, try again
                if self.ready.is_set():
                    self._lost(e)
                elif str(e) != self._last_error and not self.closed:
                    log.warning("KV link (%s) not up yet: %s", self.cfg.kv_role, str(e).splitlines()[0])
                self._last_error = str(e)
                if self.rank == 1:
                    store = None  # the producer may have restarted: a new store
                    self._stop.wait(FOREIGN_RETRY_S if isinstance(e, ForeignPort) else 1.0)
            old, self.pg = self.pg, None
            if old is not None:  # its pending receives end here, before the next generation
                try:
                    old.abort()
                except Exception:  # noqa: BLE001
                    pass

    def _store(self):
        wait = self.cfg.kv_timeout_s if self.rank == 0 else min(self.cfg.kv_timeout_s, CONNECT_S)
        if self.rank == 1:  # a producer not up yet: a plain connect fails quietly, where torch's store
            socket.create_connection((self.cfg.kv_ip, self.cfg.kv_port), timeout=wait).close()  # logs C++ stacks
        try:
            if self.rank == 0:
                return self._listening_store(datetime.timedelta(seconds=wait))
            return dist.TCPStore(self.cfg.kv_ip, self.cfg.kv_port, None, False,
                                 timeout=datetime.timedelta(seconds=wait), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - torch raises several kinds
            if self.rank == 0:
                raise
            raise ForeignPort(f"{self.cfg.kv_ip}:{self.cfg.kv_port} answers, but not as a pagedkv prefill "
                              f"instance's KV store (another service on kv_port?): {str(e).splitlines()[0]}") from None

    def _listening_store(self, timeout: datetime.timedelta):
        """The producer's store, listening on ``kv_ip`` only: a socket bound there is handed
        to torch (whose own listens on every interface); a torch that does not take one
        listens as it does, with a warning."""
        family, kind, proto, _, addr = socket.getaddrinfo(self.cfg.kv_ip, self.cfg.kv_port,
                                                         type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(64)
            store = dist.TCPStore(self.cfg.kv_ip, self.cfg.kv_port, None, True, timeout=timeout,
                                  wait_for_workers=False, master_listen_fd=sock.fileno())
        except TypeError:  # (a torch without master_listen_fd)
            sock.close()
            log.warning("KV link: this torch cannot listen on kv_ip only; the store listens on every interface")
            return dist.TCPStore(self.cfg.kv_ip, self.cfg.kv_port, None, True, timeout=timeout,
                                 wait_for_workers=False)
        except BaseException:
            sock.close()
            raise
        self._listen_sock = sock  # the store serves on its descriptor: keep it open
        return store

    def _proof(self, role: str, nonce: str) -> str:
        """``role``'s proof that it holds the shared secret, for ``nonce`` (hex digest)."""
        return hmac.new(self.cfg.secret, f"{role}:{nonce}:{self.fingerprint}".encode(), hashlib.sha256).hexdigest()

    def _connect(self, store) -> bool:
        """Build this generation's group and shake hands; False when no consumer came. The
        producer builds its group only once a consumer has said it joins this generation (a
        key in the store, polled quietly: a group built for nobody logs torch's socket
        timeouts every few seconds)."""
        if self.rank == 0:
            self.generation += 1
            self._nonce = secrets.token_hex(16)
            store.set(f"nonce-{self.generation}", self._nonce)
            store.set("generation", str(self.generation))
            polls = 0
            while not store.check([f"join-{self.generation}"]):
                if self._stop.wait(JOIN_POLL_S):
                    return False
                polls += 1
                if polls % 10 == 0 and store.get("generation") != str(self.generation).encode():
                    store.set("generation", str(self.generation))  # another process wrote it: consumers would hang
        else:
            self.generation = int(store.get("generation"))
            self._nonce = store.get(f"nonce-{self.generation}").decode()
            store.set(f"join-{self.generation}", "1")
        self._late = []
        prefix = dist.PrefixStore(f"kv-link-{self.generation}", store)
        wait = datetime.timedelta(seconds=JOIN_S if self.rank == 0 else min(self.cfg.kv_timeout_s, JOIN_S))
        try:
            pg = dist.ProcessGroupGloo(prefix, self.rank, 2, wait)
        except RuntimeError:
            if self.rank == 0:
                return False  # nobody joined: the next generation
            raise
        if not (self._hello_consumer(pg) if self.rank == 1 else self._hello_producer(pg)):
            return False
        self.pg = pg
        self.ready.set()
        log.warning("KV link up: %s (generation %d)%s", "consumer connected" if self.rank == 0 else
                    f"linked to the prefill instance at {self.cfg.kv_ip}:{self.cfg.kv_port}", self.generation,
                    "; the prefill instance pushes KV layer by layer (PUT_ASYNC)" if (
                        self.peer_pushes if self.rank == 1 else self.cfg.kv_send_type == "PUT_ASYNC") else "")
        return True

    def _hello_consumer(self, pg) -> bool:
        """The consumer's half of the handshake: the same pages on both ends and, with a
        secret, a producer that proves it holds it; else the link is refused for good."""
        cnonce = secrets.token_hex(16)
        hello = {"op": "hello", "fingerprint": self.fingerprint, "layout": self.layout, "nonce": cnonce}
        if self.cfg.secret is not None:
            hello["proof"] = self._proof("consumer", self._nonce)
        self._send_parts(HELLO_TAG, self._message(hello), pg)
        meta, _ = self.recv(HELLO_TAG, pg=pg, max_meta=HELLO_BYTES, max_data=0)
        self.peer_pushes = bool(meta.get("push"))
        if meta.get("auth") is False:
            self.refused = ("the prefill instance requires the link's shared secret (kv_secret or "
                            "$PAGEDKV_KV_SECRET), which this instance does not hold" if self.cfg.secret is None else
                            "the prefill instance refused this instance's shared secret: the two hold different "
                            "secrets (kv_secret or $PAGEDKV_KV_SECRET)")
        elif meta.get("auth") == "none":
            self.refused = ("the prefill instance holds no shared secret, and this instance requires one: set the "
                            "same kv_secret or $PAGEDKV_KV_SECRET on both")
        elif self.cfg.secret is not None and not hmac.compare_digest(str(meta.get("proof", "")),
                                                                      self._proof("producer", cnonce)):
            self.refused = "the prefill instance does not hold this link's shared secret: no KV is transferred"
        elif not meta.get("ok"):
            self.refused = ("the prefill instance's KV pages differ from this instance's ("
                            + (", ".join(meta.get("differ") or []) or "static scales") + "): no KV is transferred")
        if self.refused is not None:
            log.error("KV link refused: %s", self.refused)
            return False
        return True

    def _hello_producer(self, pg) -> bool:
        """The producer's half: a consumer without the secret (when one is set) or with other
        pages is refused with one log line, and the next generation opens."""
        meta, _ = self.recv(HELLO_TAG, datetime.timedelta(seconds=SILENT_S), pg=pg, max_meta=HELLO_BYTES,
                            max_data=0)
        if self.cfg.secret is not None and not hmac.compare_digest(str(meta.get("proof", "")),
                                                                    self._proof("consumer", self._nonce)):
            self._send_parts(HELLO_TAG, self._message({"ok": False, "auth": False}), pg)
            log.error("KV link: refused a peer that does not hold this instance's shared secret (kv_secret or "
                      "$PAGEDKV_KV_SECRET)")
            return False
        if self.cfg.secret is None and "proof" in meta:  # it will not take a producer that cannot prove one
            self._send_parts(HELLO_TAG, self._message({"ok": False, "auth": "none"}), pg)
            log.error("KV link: refused a consumer that requires a shared secret, which this instance does not "
                      "hold (set the same kv_secret or $PAGEDKV_KV_SECRET on both)")
            return False
        ok = meta.get("op") == "hello" and meta.get("fingerprint") == self.fingerprint
        theirs = meta.get("layout") or {}
        differ = sorted(k for k in set(theirs) | set(self.layout) if theirs.get(k) != self.layout.get(k))
        answer = {"ok": ok, "differ": differ, "push": self.cfg.kv_send_type == "PUT_ASYNC"}
        if self.cfg.secret is not None:
            answer["proof"] = self._proof("producer", str(meta.get("nonce", "")))
        self._send_parts(HELLO_TAG, self._message(answer), pg)
        if not ok:
            log.error("KV link: a consumer with other KV pages connected (%s); refused",
                      ", ".join(differ) or "static scales")
        return ok

    @staticmethod
    def _message(meta: dict, data: torch.Tensor | None = None) -> list[torch.Tensor]:
        """A message's parts: header (JSON bytes, data bytes), JSON, then the data if any."""
        body = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        n = 0 if data is None else data.numel()
        return [torch.tensor([body.numel(), n], dtype=torch.int64), body] + ([data] if n else [])

    def _serve(self) -> None:
        """Producer: answer requests until the link fails or the consumer falls silent."""
        silent = datetime.timedelta(seconds=SILENT_S)
        while self.ready.is_set() and not self.closed:
            meta, _ = self.recv(REQUEST_TAG, silent)
            if meta.get("op") != "ping" and self.on_request is not None:
                self.on_request(self, meta)

    def _heartbeat(self) -> None:
        """Consumer: the engine thread pulls over the link; this thread says it is alive (and
        another takes the producer's pushes, so a push never waits on a receive)."""
        if self.on_push is not None:
            threading.Thread(target=self._listen, args=(self.pg,), name="pagedkv-kv-push-recv", daemon=True).start()
        while self.ready.is_set() and not self.closed:
            self.send(REQUEST_TAG, {"op": "ping"})
            if self.on_heartbeat is not None:
                self.on_heartbeat()
            self._stop.wait(PING_S)

    def _listen(self, pg) -> None:
        """Consumer: receive pushes on :data:`PUSH_TAG` until this generation's group ends
        (aborted when the link drops or closes, which ends the wait)."""
        forever = datetime.timedelta(days=1)
        while self.pg is pg and not self.closed:
            try:
                meta, data = self.recv(PUSH_TAG, forever, pg=pg, alloc=self.push_alloc)
            except (LinkError, RuntimeError):
                return
            try:
                self.on_push(meta, data)
            except Exception:  # noqa: BLE001 - a bad push is dropped, the link stays
                log.exception("KV link: a pushed message could not be taken")
