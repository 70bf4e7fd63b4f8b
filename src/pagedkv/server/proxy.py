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
  frees its pages; an unpulled lease on the producer ends within its ``kv_lease_s``).

``/health`` is 200 when both instances say so, else 503; ``/v1/models`` is the decode
instance's. The ``Authorization`` header is passed on to both.
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

log = logging.getLogger("pagedkv.proxy")
LEG_PATHS = ("/v1/completions", "/v1/chat/completions")
LIVENESS_S = 2.0  # the producer's /health must answer within this before each prefill leg


def _error_body(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(_error_body(message, code), status_code=status)


async def until_disconnect(request: Request, leg):
    """Await ``leg`` (a coroutine) unless the client disconnects first: then cancel it (its
    connection closes, which aborts the request upstream) and return None. A non-streamed
    leg sends nothing until it is done, so nothing else would notice the client leaving."""
    task = asyncio.ensure_future(leg)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return None


async def _relay(upstream: httpx.Response, events: bool):
    """The decode leg's body. An event stream goes on whole events at a time, so when the
    consumer dies mid-stream the client gets what a failing server sends: an error event and
    ``[DONE]`` (a cut-off partial event is dropped); another body just ends, logged."""
    pending = b""
    try:
        async for chunk in upstream.aiter_raw():
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
            err = _error_body(f"the decode instance failed mid-stream ({type(e).__name__})", "decode_failed")
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


def build_proxy(prefill_url: str, decode_url: str, timeout: float = 600.0) -> FastAPI:
    """The proxy app over the two instances' base URLs (``http://host:port``)."""
    app = FastAPI(title="pagedkv proxy")
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0),  # as many legs as clients
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    prefill_url, decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")

    async def healthy(url: str, timeout: float) -> bool:
        """Whether the instance's ``/health`` answers 200 within ``timeout`` seconds."""
        try:
            return (await client.get(url + "/health", timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False

    def headers(request: Request) -> dict:
        auth = request.headers.get("authorization")
        return {"authorization": auth} if auth else {}

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
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_json")
        hdrs, transfer_id = headers(request), uuid.uuid4().hex
        prefilled = await prefill_leg(path, body, hdrs, transfer_id)
        if isinstance(prefilled, Response):
            return prefilled
        leg = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if prefilled:  # else the decode instance computes the prompt: no transfer to wait for
            leg["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": transfer_id}
        try:
            upstream = await until_disconnect(request, client.send(
                client.build_request("POST", decode_url + path, json=leg, headers=hdrs), stream=True))
        except httpx.HTTPError as e:
            return _error(502, f"the decode instance is unavailable ({type(e).__name__})", "decode_unavailable")
        if upstream is None:  # the client left before the decode leg answered: closing it aborts the request
            return Response(status_code=499)
        if upstream.status_code >= 500:
            await upstream.aclose()
            return _error(502, f"the decode instance failed (HTTP {upstream.status_code})", "decode_failed")
        media = upstream.headers.get("content-type")
        return StreamingResponse(_relay(upstream, (media or "").startswith("text/event-stream")),
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
        try:
            r = await client.get(decode_url + "/v1/models", headers=headers(request))
        except httpx.HTTPError as e:
            return _error(502, f"the decode instance is unavailable ({type(e).__name__})", "decode_unavailable")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    app.router.on_shutdown.append(client.aclose)
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
                                          "(disaggregated prefill/decode).", epilog=PROXY_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", required=True, help="the prefill instance's base URL (http://host:port)")
    p.add_argument("--decode", required=True, help="the decode instance's base URL")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds either leg may take before the proxy gives up on it (default: %(default)s)")
    p.set_defaults(func=_run)
    return p


def _run(args) -> int:
    import sys

    from pagedkv.server.cli import bind_socket, uvicorn_server
    from pagedkv.server.http_limits import HTTPLimits

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
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        raise ValueError(str(e)) from None
    host, port = sock.getsockname()[:2]
    print(f"pagedkv proxy on http://{host}:{port}: prefill {args.prefill}, decode {args.decode}", file=sys.stderr,
          flush=True)
    uvicorn_server(build_proxy(args.prefill, args.decode, args.timeout), 5.0, HTTPLimits(),
                   log_level="warning").run(sockets=[sock])
    return 0
