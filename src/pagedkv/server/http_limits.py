"""Slow clients: deadlines on reading a request and on a client reading a response, and a
cap on connections.

uvicorn's h11 protocol waits forever for a request's headers (its keep-alive timeout only
runs between requests) and for its body, so a client that sends a few bytes and stalls
holds a connection, and at shutdown holds the process. Per connection:

    connect / last response done --(headers, header_timeout_s)--> request --(body, body_timeout_s)--> app
         ^ idle between requests: timeout_keep_alive_s

A deadline that passes with the client still sending closes the connection (the app
sees a disconnect: 499, nothing to abort). A client that stops reading a response (a
stream, typically) fills the socket and the transport's buffer, and asyncio pauses
writing: if writing stays paused for ``write_timeout_s``, the connection is aborted (the
stream ends, and its engine requests are aborted and their blocks freed), so neither the
engine's work nor the connection is held by a client that went away without closing.
``limit_concurrency`` connections or
requests in flight make uvicorn answer further requests 503. At shutdown,
:func:`cut_stalled` closes connections still sending a request and aborts those whose
client is not reading, so the drain time holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class HTTPLimits:
    """Seconds for each deadline; ``limit_concurrency`` in connections (None: no cap)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    timeout_keep_alive_s: float = 5.0
    limit_concurrency: int | None = 1024

    def uvicorn_kwargs(self) -> dict:
        """What ``uvicorn.Config`` takes to enforce these limits."""
        protocol = type("LimitedH11Protocol", (DeadlineH11Protocol,), {"limits": self})
        # uvicorn answers 503 once connections >= its limit, the asking one counted: one more
        # lets limit_concurrency connections be served, as the flag says
        return {"http": protocol, "timeout_keep_alive": self.timeout_keep_alive_s,
                "limit_concurrency": None if self.limit_concurrency is None else self.limit_concurrency + 1}


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header, body and write deadlines (``limits``)."""

    limits: HTTPLimits = HTTPLimits()
    _deadline = None
    _write_deadline = None
    _write_timeout_s: float | None = None   # set at shutdown: shorter than limits'

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)

    def handle_events(self) -> None:
        was = self.cycle
        super().handle_events()
        if self.cycle is not was and self.cycle is not None:  # a request's headers arrived
            self._arm(self.limits.body_timeout_s)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.still_reading() == "headers":
            self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.resume_writing_deadline()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        seconds = self._write_timeout_s if self._write_timeout_s is not None else self.limits.write_timeout_s
        self._write_deadline = self.loop.call_later(seconds, self.cut_if_not_reading)

    def resume_writing(self) -> None:
        self.resume_writing_deadline()
        super().resume_writing()

    def resume_writing_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def cut_if_not_reading(self) -> None:
        """Abort the connection if its client has not read what was sent (writing is
        paused); close() would wait for that buffer to drain, which may be never."""
        if self.transport is not None and not self.transport.is_closing() and self.flow.write_paused:
            self.transport.abort()

    def end_drain(self, grace_s: float) -> None:
        """Shutdown's drain time is over: close the connection if its client is still
        sending a request; abort it if the client is not reading, now or within
        ``grace_s`` of writing pausing (the last chunks of aborted streams are on the way)."""
        self.cut_if_reading()
        self._write_timeout_s = grace_s
        self.cut_if_not_reading()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (bad request line, a repeated Host, a malformed
        Content-Length, ...): an OpenAI-style JSON 400 instead of uvicorn's plain text."""
        body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}", "type": "invalid_request_error",
                                     "param": None, "code": "invalid_http"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def still_reading(self) -> str | None:
        """'headers' or 'body' while the client is still sending that part of a request."""
        if self.transport is None or self.transport.is_closing():
            return None
        if self.cycle is None or self.cycle.response_complete:
            return "headers"
        return "body" if self.conn.their_state is h11.SEND_BODY else None

    def cut_if_reading(self) -> None:
        """Close the connection if the client is still sending a request."""
        if self.still_reading() is not None:
            self.transport.close()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self.cut_if_reading)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


def cut_stalled(connections, grace_s: float = 1.0) -> None:
    """Shutdown: the drain time is over. Close each connection whose client is still
    sending a request (it can never be answered) and abort each whose client is not
    reading (see :meth:`DeadlineH11Protocol.end_drain`)."""
    for conn in list(connections):
        if isinstance(conn, DeadlineH11Protocol):
            conn.end_drain(grace_s)
