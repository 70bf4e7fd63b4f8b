"""The FastAPI app: OpenAI-compatible routes around one :class:`EngineLoop`.

    POST /v1/completions        POST /v1/chat/completions   (stream: true -> SSE, data: [DONE])
    GET  /v1/models             GET  /v1/models/{id}
    POST /tokenize              POST /detokenize            GET /tokenizer_info   (vLLM's)
    GET  /health                GET  /metrics (Prometheus text)

Security defaults: with API keys configured, ``/v1/*`` needs ``Authorization: Bearer
<key>`` (401 otherwise) and each key gets its own prefix cache (``cache_salt`` = a hash
of the key), so one tenant's timings cannot reveal another's prompts. Without keys,
:class:`~pagedkv.server.host_guard.HostGuard` accepts only loopback (or ``allowed_hosts``)
Host names and refuses cross-origin browser requests (403). POST bodies must be
uncompressed ``application/json`` (415 otherwise); bodies over ``max_body_bytes`` get 413
before they are read in full. Errors never carry stack traces: an exception a route lets
escape becomes a 500 JSON body and one log record.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pagedkv.config.engine import SCORED_EVICTIONS
from pagedkv.engine.engine import LLMEngine
from pagedkv.model.loader import load_tokenizer
from pagedkv.reprs import brief
from pagedkv.server import generate
from pagedkv.server.engine_loop import EngineLoop
from pagedkv.server.host_guard import HostGuard
from pagedkv.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.server.prompts import Prompts
from pagedkv.server.protocol import APIError, parse_chat, parse_completion
from pagedkv.server.responses import TokenIdText, TokenText
from pagedkv.server.tokenizer_routes import parse_detokenize, parse_tokenize, tokenizer_info

log = logging.getLogger("pagedkv.server")
DEFAULT_MAX_BODY_BYTES = 2**20


@dataclass
class ServerConfig:
    """``served_model_names[0]`` is the name responses carry; any of them is accepted.
    ``allowed_hosts``: Host names accepted besides loopback when ``api_keys`` is empty
    (``"*"``: any)."""

    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    isolate_prefix_cache: bool = True
    allowed_hosts: list[str] = field(default_factory=list)


class Server:
    """What the routes share: the engine loop, metrics, a tokenizer for the HTTP side
    (its own instance: the engine thread uses the engine's), which ``prompts`` runs off
    the event loop, and the config."""

    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics(lambda: self.loop.stats)
        self.loop = EngineLoop(engine, observer=self.metrics.observe)
        self.tokenizer = load_tokenizer(engine.model_files.folder)  # its own: the engine thread uses the engine's
        self.token_text = TokenText(self.tokenizer)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.engine_config = engine.config
        self.prompts = Prompts(self.tokenizer, engine.max_model_len, self.vocab_size)
        self.capacity_tokens = engine.capacity_tokens
        self.created = int(time.time())

    # ---- request checks ------------------------------------------------------------
    def tenant_salt(self, request: Request) -> str | None:
        """The prefix-cache salt of the caller. Raises APIError 401 on a missing/wrong key."""
        if not self.config.api_keys:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key_b = key.strip().encode("latin-1")  # the header's bytes (a UTF-8 key arrives as UTF-8 bytes)
        ok = scheme.lower() == "bearer" and key_b and any(
            hmac.compare_digest(key_b, k.encode()) for k in self.config.api_keys)
        if not ok:
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if not self.config.isolate_prefix_cache:
            return None
        return "key:" + hashlib.sha256(key_b).hexdigest()[:32]

    async def read_json(self, request: Request) -> dict:
        """The body as a JSON object. Raises APIError 415 (not uncompressed JSON), 413 (over
        ``max_body_bytes``) or 400 (not a JSON object)."""
        _require_json(request.headers)
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        return body

    def model_name(self, requested: str | None) -> str:
        names = self.config.served_model_names
        if requested is not None and requested not in names:
            raise APIError(404, f"the model '{requested}' does not exist; this server serves {names}",
                           param="model", code="model_not_found")
        return names[0]

    def default_max_tokens(self, num_prompt: int) -> int:
        """Without max_tokens: up to the context or the whole cache, whichever is smaller."""
        return max(1, min(self.max_model_len, self.capacity_tokens) - num_prompt)

    # ---- endpoints -----------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        salt = self.tenant_salt(request)
        req = parse_completion(await self.read_json(request))
        model = self.model_name(req.model)
        prompts = await self.prompts.completion(req.prompts)
        return await self._generate(request, req, prompts, model, salt)

    async def chat(self, request: Request) -> Response:
        salt = self.tenant_salt(request)
        req = parse_chat(await self.read_json(request))
        model = self.model_name(req.model)
        return await self._generate(request, req, [await self.prompts.chat(req.messages)], model, salt)

    async def _generate(self, request, req, prompts, model, salt) -> Response:
        bad_id = next((t for t in req.params.stop_token_ids if t >= self.vocab_size), None)
        if bad_id is not None:
            raise APIError(400, f"stop token id {brief(bad_id)} is outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids", code="invalid_value", reason="out_of_vocabulary")
        self._check_budget(req.params.kv_budget_tokens)
        if req.cache_salt:
            salt = f"{salt or ''}|user:{req.cache_salt}"
        tt = TokenIdText(self.tokenizer) if req.return_tokens_as_token_ids else self.token_text
        job = await generate.start(self.loop, req, prompts, model, self.default_max_tokens, salt, tt)
        if req.stream:
            return generate.AbortingStream(self.loop, job)
        return await generate.respond(self.loop, job, request)

    def _check_budget(self, budget: int | None) -> None:
        """A request's ``kv_budget_tokens`` must suit this engine (else 400 naming the field)."""
        c = self.engine_config
        if budget is None:
            return
        if c.kv_eviction not in SCORED_EVICTIONS:
            raise APIError(400, "'kv_budget_tokens' needs a server started with --kv-eviction snapkv|h2o",
                           param="kv_budget_tokens", code="invalid_value")
        if budget < c.num_sink_tokens + c.kv_window_tokens:
            raise APIError(400, f"'kv_budget_tokens' must be at least the server's sinks + window "
                           f"({c.num_sink_tokens} + {c.kv_window_tokens}), got {budget}",
                           param="kv_budget_tokens", code="invalid_value")

    async def models(self, request: Request) -> dict:
        self.tenant_salt(request)
        return {"object": "list", "data": [self._model_card(name) for name in self.config.served_model_names]}

    async def model(self, request: Request, model_id: str) -> dict:
        """One served model (the openai client's ``models.retrieve``). Raises APIError 404."""
        self.tenant_salt(request)
        self.model_name(model_id)
        return self._model_card(model_id)

    async def tokenize(self, request: Request) -> dict:
        """vLLM's ``/tokenize``. Raises APIError 400/401/404."""
        self.tenant_salt(request)
        req = parse_tokenize(await self.read_json(request))
        self.model_name(req.model)
        ids, strs = await self.prompts.tokenize(req)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict:
        """vLLM's ``/detokenize``. Raises APIError 400/401/404."""
        self.tenant_salt(request)
        model, ids = parse_detokenize(await self.read_json(request), self.vocab_size)
        self.model_name(model)
        return {"prompt": await self.prompts.detokenize(ids)}

    async def tokenizer_info(self, request: Request) -> dict:
        self.tenant_salt(request)
        return tokenizer_info(self.tokenizer, self.max_model_len)

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pagedkv",
                "max_model_len": self.max_model_len}


def _require_json(headers) -> None:
    """Raises APIError 415 unless the body is declared ``application/json`` and not encoded
    (400 if either header is repeated: which one counts would be the parser's guess):
    a browser page can send ``text/plain`` cross-site without a CORS preflight, never JSON."""
    for name in ("content-type", "content-encoding"):
        if len(headers.getlist(name)) > 1:
            raise APIError(400, f"the request has more than one {name} header", code="duplicate_header")
    media = headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"the body must be sent with 'Content-Type: application/json', not "
                       f"{media or 'none'!r}", code="unsupported_media_type")
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                       code="unsupported_media_type")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine loop and, at shutdown, aborts what is
    still running and stops it."""
    server = Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        try:
            yield
        finally:
            server.prompts.close()
            server.loop.stop()

    app = FastAPI(title="pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"])  # ids may hold '/'
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", server.tokenizer_info, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        reason = server.loop.unavailable_reason()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    _add_error_handlers(app, server)
    app.add_middleware(CatchAll)  # innermost: an escaped exception is logged once
    if not config.api_keys:
        app.add_middleware(HostGuard, allowed_hosts=config.allowed_hosts,
                           on_refuse=lambda: server.metrics.reject("unauthorized"))
    return app


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


def _add_error_handlers(app: FastAPI, server: Server) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        if e.count and 400 <= e.status < 500:
            server.metrics.reject("unauthorized" if e.status == 401 else e.reason)
        return ErrorJSON(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return ErrorJSON(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code,
                         headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)
