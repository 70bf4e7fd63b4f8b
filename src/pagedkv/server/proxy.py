"""``pagedkv proxy``: one OpenAI endpoint in front of a prefill and a decode instance.

For each completion or chat request it makes a transfer id, sends the *prefill leg* to the
producer (``max_tokens`` 1, not streamed, ``kv_transfer_params`` ``do_remote_decode``), then
the *decode leg* to the consumer (the client's own body plus ``do_remote_prefill``), which
pulls the prompt's KV instead of computing it, and answers the client with the decode
leg's response, streamed or not. The client never waits on a dead instance:

- a prefill leg the producer refuses (4xx) goes back to the client as it is;
- a producer that is down, unhealthy (its ``/health`` not 200 within ``LIVENESS_S``: also one
  that hangs), fails (5xx) or does not answer in ``--timeout`` seconds is skipped: the decode
  leg goes without a transfer and the consumer computes the prompt;
- a consumer that is down or fails answers 502 (its own 4xx go back as they are); one that
  dies mid-stream ends the stream with an error event and ``[DONE]``;
- a client that disconnects closes the decode leg (the consumer aborts the request and
  frees its pages; an unpulled lease on the producer ends within its ``kv_lease_s``, or
  sooner when the producer needs the pages);
- a decode leg that fails on a pooled connection before any answer (the consumer closed it
  as idle) is sent once more on a fresh one.

At shutdown (SIGINT/SIGTERM) in-flight requests get ``--shutdown-timeout`` seconds, as
``pagedkv serve`` gives them; then streams end with an error event and ``[DONE]``, waiting
calls get 503, and the decode legs are closed (the consumer aborts them).

``/health`` is 200 when both instances say so, else 503; ``/v1/models`` is the decode
instance's. The ``Authorization`` header is passed on to both, byte for byte.

The proxy keeps the server's promises itself (:mod:`pagedkv.server.guards`, one
implementation): API keys, the Host/Origin checks, JSON-only bodies within
``--max-body-bytes``, read deadlines and ``--limit-concurrency``; it re-sends each leg with
its own loopback Host, so the instances behind it never see what a browser sent. A body is
checked as the server checks it (:func:`~pagedkv.server.protocol.parse_completion`,
:func:`~pagedkv.server.protocol.parse_chat`) before any leg runs: a request the decode
instance would refuse never leaves pages leased on the producer (a decode instance that
refuses one anyway releases its transfer at once: :meth:`pagedkv.server.app.Server.releasing`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagedkv.server.errors import ErrorJSON, install_error_handlers
from pagedkv.server.guards import GuardConfig, Guards, add_guard_args, guard_config, is_loopback
from pagedkv.server.protocol import parse_chat, parse_completion

log = logging.getLogger("pagedkv.proxy")
LEG_PATHS = {"/v1/completions": parse_completion, "/v1/chat/completions": parse_chat}
LIVENESS_S = 2.0  # the producer's /health must answer within this before each prefill leg
KEEPALIVE_S = 2.0  # pooled connections to the instances idle longer are not reused (uvicorn closes them at 5 s)
RETRYABLE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)  # a pooled connection closed under us


def _error_body(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def _error(status: int, message: str, code: str) -> JSONResponse:
    return ErrorJSON(_error_body(message, code), status_code=status)


STOPPED = object()  # until_disconnect's answer when the proxy stops first


async def until_disconnect(request: Request, leg, stop: asyncio.Event):
    """Await ``leg`` (a coroutine) unless the client disconnects first (then None) or the
    proxy stops (then STOPPED): either cancels it (its connection closes, which aborts the
    request upstream). A non-streamed leg sends nothing until it is done, so nothing else
    would notice the client leaving."""
    task = asyncio.ensure_future(leg)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if stop.is_set() or await request.is_disconnected():
            task.cancel()
            return STOPPED if stop.is_set() else None


def _stream_error(message: str, code: str) -> bytes:
    return f"data: {json.dumps(_error_body(message, code))}\n\ndata: [DONE]\n\n".encode()


async def _relay(upstream: httpx.Response, events: bool, stop: asyncio.Event):
    """The decode leg's body. An event stream goes on whole events at a time, so when the
    consumer dies mid-stream, or the proxy stops, the client gets what a failing server
    sends: an error event and ``[DONE]`` (a cut-off partial event is dropped); another body
    just ends, logged."""
    pending, chunks = b"", upstream.aiter_raw().__aiter__()
    stopped = asyncio.ensure_future(stop.wait())
    try:
        while True:
            nxt = asyncio.ensure_future(chunks.__anext__())
            await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                if events:
                    yield _stream_error("the proxy is shutting down", "shutting_down")
                return
            try:
                chunk = nxt.result()
            except StopAsyncIteration:
                break
            if not events:
                yield chunk
                continue
            pending += chunk
            cut = pending.rfind(b"\n\n") + 2
            if cut > 1:
                yield pending[:cut]
                pending = pending[cut:]
        if pending:
            yield pending
    except httpx.HTTPError as e:
        log.warning("the decode instance broke off a response (%s)", type(e).__name__)
        if events:
            yield _stream_error(f"the decode instance failed mid-stream ({type(e).__name__})", "decode_failed")
    finally:
        stopped.cancel()


def build_proxy(prefill_url: str, decode_url: str, timeout: float = 600.0,
                guard: GuardConfig = GuardConfig()) -> FastAPI:
    """The proxy app over the two instances' base URLs (``http://host:port``), enforcing
    ``guard`` (API keys, hosts, body size) as ``pagedkv serve`` does."""
    app = FastAPI(title="pagedkv proxy", docs_url=None, redoc_url=None, openapi_url=None)
    guards = Guards(guard)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0),  # as many legs as clients
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                   keepalive_expiry=KEEPALIVE_S))
    draining, stop = asyncio.Event(), asyncio.Event()  # shutdown began; its drain time is over
    app.state.begin_drain, app.state.abort_all = draining.set, stop.set  # (the CLI's graceful shutdown)
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")

    async def healthy(url: str, timeout: float) -> bool:
        """Whether the instance's ``/health`` answers 200 within ``timeout`` seconds."""
        try:
            return (await client.get(url + "/health", timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False

    def headers(request: Request) -> dict:
        """The client's Authorization header as it came (its bytes: a UTF-8 key too)."""
        auth = request.headers.get("authorization")
        return {"authorization": auth.encode("latin-1")} if auth else {}

    async def send_decode_leg(path: str, leg: dict, hdrs: dict) -> httpx.Response:
        """The decode leg, streamed; once more on a fresh connection if a pooled one was
        closed before any answer (nothing was run for it)."""
        for attempt in (1, 2):
            try:
                return await client.send(client.build_request("POST", decode_url + path, json=leg, headers=hdrs),
                                         stream=True)
            except RETRYABLE as e:
                if attempt == 2:
                    raise
                log.info("the decode leg's connection closed before an answer (%s): sent again", type(e).__name__)

    async def prefill_leg(path: str, body: dict, hdrs: dict, transfer_id: str) -> Response | bool:
        """The producer's answer when the client must see it (a 4xx), else whether the prompt's
        KV waits there for the decode leg."""
        leg = {**body, "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                                      "transfer_id": transfer_id}}
        leg.pop("stream_options", None)
        for key in ("max_tokens", "max_completion_tokens"):
            leg.pop(key, None)
        leg["max_tokens"] = 1
        if not await healthy(prefill_url, LIVENESS_S):  # a hung producer still accepts connections
            log.warning("prefill instance not healthy within %.0f s: the decode instance computes the prompt",
                        LIVENESS_S)
            return False
        try:
            r = await client.post(prefill_url + path, json=leg, headers=hdrs)
        except httpx.HTTPError as e:
            log.warning("prefill instance unreachable (%s): the decode instance computes the prompt", type(e).__name__)
            return False
        if 400 <= r.status_code < 500:
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        if r.status_code != 200:
            log.warning("prefill instance answered %d: the decode instance computes the prompt", r.status_code)
        return r.status_code == 200

    async def forward(path: str, request: Request) -> Response:
        guards.api_key(request)
        body = await guards.read_json(request)
        LEG_PATHS[path](body)  # the server's own checks: refused here, before any leg (APIError)
        if draining.is_set():
            return _error(503, "the proxy is shutting down", "shutting_down")
        hdrs, transfer_id = headers(request), uuid.uuid4().hex
        prefilled = await prefill_leg(path, body, hdrs, transfer_id)
        if isinstance(prefilled, Response):
            return prefilled
        leg = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if prefilled:  # else the decode instance computes the prompt: no transfer to wait for
            leg["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": transfer_id}
        try:
            upstream = await until_disconnect(request, send_decode_leg(path, leg, hdrs), stop)
        except httpx.HTTPError as e:
            return _error(502, f"the decode instance is unavailable ({type(e).__name__})", "decode_unavailable")
        if upstream is STOPPED:
            return _error(503, "the proxy is shutting down", "shutting_down")
        if upstream is None:  # the client left before the decode leg answered: closing it aborts the request
            return Response(status_code=499)
        if upstream.status_code >= 500:
            await upstream.aclose()
            return _error(502, f"the decode instance failed (HTTP {upstream.status_code})", "decode_failed")
        media = upstream.headers.get("content-type")
        return StreamingResponse(_relay(upstream, (media or "").startswith("text/event-stream"), stop),
                                 status_code=upstream.status_code, media_type=media,
                                 background=BackgroundTask(upstream.aclose))

    def route(path: str):
        async def handler(request: Request) -> Response:
            return await forward(path, request)
        return handler

    for path in LEG_PATHS:
        app.add_api_route(path, route(path), methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill_url, decode_url):
            if not await healthy(url, 5.0):
                return JSONResponse({"status": "unavailable", "instance": url}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        guards.api_key(request)
        try:
            r = await client.get(decode_url + "/v1/models", headers=headers(request))
        except httpx.HTTPError as e:
            return _error(502, f"the decode instance is unavailable ({type(e).__name__})", "decode_unavailable")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    app.router.on_shutdown.append(client.aclose)
    install_error_handlers(app)
    guards.install(app)
    return app


PROXY_EXAMPLES = """example (one machine: a prefill and a decode instance, then the proxy):
  pagedkv serve --port 8100 --kv-transfer-config '{"kv_connector": "TorchDistConnector", "kv_role": "kv_producer"}'
  pagedkv serve --port 8200 --kv-transfer-config '{"kv_connector": "TorchDistConnector", "kv_role": "kv_consumer"}'
  pagedkv proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
(add "kv_send_type": "PUT_ASYNC" to the producer's config to push each layer's KV during the prefill)
"""


def add_parser(subparsers):
    """Register ``proxy``; ``func`` returns an exit code."""
    import argparse

    p = subparsers.add_parser("proxy", help="one OpenAI endpoint over a prefill and a decode instance",
                              description="One OpenAI endpoint in front of a prefill and a decode instance "
                                          "(disaggregated prefill/decode). It enforces what pagedkv serve does, "
                                          "with the same flags: API keys, the Host/Origin checks without a key, "
                                          "JSON bodies within --max-body-bytes, read deadlines, "
                                          "--limit-concurrency; a body is checked before either leg runs.",
                              epilog=PROXY_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", required=True, help="the prefill instance's base URL (http://host:port)")
    p.add_argument("--decode", required=True, help="the decode instance's base URL")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds either leg may take before the proxy gives up on it (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGINT/SIGTERM; then streams end with an "
                        "error event and [DONE] and waiting calls get 503 (default: %(default)s)")
    add_guard_args(p.add_argument_group("security and limits (as pagedkv serve's)"), "the proxy")
    p.set_defaults(func=_run)
    return p


def _run(args) -> int:
    import sys

    from pagedkv.server.cli import bind_socket, uvicorn_server

    for name in ("prefill", "decode"):
        url = getattr(args, name)
        try:
            host = httpx.URL(url).host if url.startswith(("http://", "https://")) else ""
        except httpx.InvalidURL:
            host = ""
        if not host:
            raise ValueError(f"--{name} must be a URL such as http://127.0.0.1:8100, got {url!r}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    guard = guard_config(args)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        raise ValueError(str(e)) from None
    host, port = sock.getsockname()[:2]
    if not guard.api_keys and not is_loopback(args.host):
        print(f"warning: the proxy listens on {args.host} without --api-key: anyone who can reach it can use it "
              "(requests must name a loopback host or one in --allowed-hosts)", file=sys.stderr)
    print(f"pagedkv proxy on http://{host}:{port}: prefill {args.prefill}, decode {args.decode} "
          f"(auth {'on' if guard.api_keys else 'off'})", file=sys.stderr, flush=True)
    uvicorn_server(build_proxy(args.prefill, args.decode, args.timeout, guard), args.shutdown_timeout,
                   guard.limits, log_level="warning").run(sockets=[sock])
    return 0
