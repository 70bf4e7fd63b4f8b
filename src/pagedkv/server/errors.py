"""Error answers of every listener (``pagedkv serve`` and ``pagedkv proxy``): OpenAI-style
JSON bodies for :class:`~pagedkv.server.protocol.APIError`, Starlette's own 404/405, and
anything that escapes a route, in ASCII so any message encodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pagedkv.server.protocol import APIError

log = logging.getLogger("pagedkv.server")


class ErrorJSON(JSONResponse):
    """An error body as ASCII JSON, so a message quoting request text (even a lone
    surrogate) always encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class CatchAll:
    """ASGI middleware: an exception that escapes a route becomes a 500 JSON body (or, once
    a response has started, ends it), logged once. Starlette's own last-resort handler
    re-raises after answering, so the server logged every such traceback twice. A request
    cancelled by uvicorn's hard stop at shutdown (its engine work outlived the drain) gets a
    503 JSON body if nothing was sent yet, else its response just ends; one log line, no
    traceback, no uvicorn plain-text 500."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            log.warning("%s %s cancelled by the shutdown's hard stop", scope.get("method"), scope.get("path"))
            if not started:
                body = APIError(503, "the server is shutting down", type="server_error", code="shutting_down").body()
                with contextlib.suppress(Exception):
                    await ErrorJSON(body, status_code=503)(scope, receive, send)
        except Exception as e:  # noqa: BLE001 - the last resort: answer, log once, go on
            log.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=e)
            if not started:
                body = APIError(500, "internal server error", type="server_error").body()
                await ErrorJSON(body, status_code=500)(scope, receive, send)


def install_error_handlers(app, on_api_error=lambda e: None) -> None:
    """JSON error bodies on ``app`` (``on_api_error(e)`` sees each APIError answered, e.g.
    to count refusals) and :class:`CatchAll` as the innermost middleware."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        on_api_error(e)
        return ErrorJSON(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return ErrorJSON(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code,
                         headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)

    app.add_middleware(CatchAll)
