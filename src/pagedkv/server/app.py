"""The FastAPI app: OpenAI-compatible routes around one :class:`EngineLoop`.

    POST /v1/completions        POST /v1/chat/completions   (stream: true -> SSE, data: [DONE])
    GET  /v1/models             GET  /v1/models/{id}
    POST /tokenize              POST /detokenize            GET /tokenizer_info   (vLLM's)
    GET  /health                GET  /metrics (Prometheus text)

Security defaults (:mod:`pagedkv.server.guards`, the same in ``pagedkv proxy``): with API
keys configured, ``/v1/*`` needs ``Authorization: Bearer <key>`` (401 otherwise) and each
key gets its own prefix cache (``cache_salt`` = a hash of the key), so one tenant's timings
cannot reveal another's prompts. Without keys, only loopback (or ``allowed_hosts``) Host
names are accepted and cross-origin browser requests refused (403). POST bodies must be
uncompressed ``application/json`` (415 otherwise); bodies over ``max_body_bytes`` get 413
before they are read in full. Errors never carry stack traces: an exception a route lets
escape becomes a 500 JSON body and one log record.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedkv.config.engine import SCORED_EVICTIONS
from pagedkv.engine.engine import LLMEngine
from pagedkv.model.loader import load_tokenizer
from pagedkv.reprs import brief
from pagedkv.server import generate
from pagedkv.server.engine_loop import EngineLoop
from pagedkv.server.errors import install_error_handlers
from pagedkv.server.guards import GuardConfig, Guards
from pagedkv.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.server.prompts import Prompts
from pagedkv.server.protocol import APIError, parse_chat, parse_completion
from pagedkv.server.responses import TokenIdText, TokenText
from pagedkv.server.tokenizer_routes import parse_detokenize, parse_tokenize, tokenizer_info

log = logging.getLogger("pagedkv.server")


@dataclass
class ServerConfig:
    """``served_model_names[0]`` is the name responses carry; any of them is accepted.
    ``guards``: API keys, allowed hosts, body and connection limits (:mod:`pagedkv.server.guards`);
    ``isolate_prefix_cache``: one prefix cache per API key."""

    served_model_names: list[str]
    guards: GuardConfig = field(default_factory=GuardConfig)
    isolate_prefix_cache: bool = True


class Server:
    """What the routes share: the engine loop, metrics, a tokenizer for the HTTP side
    (its own instance: the engine thread uses the engine's), which ``prompts`` runs off
    the event loop, and the config."""

    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.config, self.guards = config, Guards(config.guards)
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
    def count_refusal(self, e: APIError) -> None:
        """Count an APIError answered to a client (a 4xx it was told to count) in /metrics."""
        if e.count and 400 <= e.status < 500:
            self.metrics.reject("unauthorized" if e.status == 401 else e.reason)

    def tenant_salt(self, request: Request) -> str | None:
        """The prefix-cache salt of the caller. Raises APIError 401 on a missing/wrong key."""
        key = self.guards.api_key(request)
        if key is None or not self.config.isolate_prefix_cache:
            return None
        return "key:" + hashlib.sha256(key).hexdigest()[:32]

    async def read_json(self, request: Request) -> dict:
        """The body as a JSON object (:meth:`Guards.read_json`: 415, 413, 400)."""
        return await self.guards.read_json(request)

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
        body = await self.read_json(request)
        with self.releasing(body):
            req = parse_completion(body)
            model = self.model_name(req.model)
            prompts = await self.prompts.completion(req.prompts)
            self._check_params(req)
        return await self._generate(request, req, prompts, model, salt)

    async def chat(self, request: Request) -> Response:
        salt = self.tenant_salt(request)
        body = await self.read_json(request)
        with self.releasing(body):
            req = parse_chat(body)
            model = self.model_name(req.model)
            prompts = [await self.prompts.chat(req.messages)]
            self._check_params(req)
        return await self._generate(request, req, prompts, model, salt)

    @contextlib.contextmanager
    def releasing(self, body: dict):
        """A decode leg (``kv_transfer_params.do_remote_prefill``) refused here, before the
        engine saw it: the producer's pages it would have pulled are released at once
        (otherwise they stay leased for ``kv_lease_s``); the refusal goes on as it was."""
        try:
            yield
        except BaseException:
            for params in decode_leg_transfers(body):
                self.loop.release_transfer(params)
            raise

    async def _generate(self, request, req, prompts, model, salt) -> Response:
        if req.cache_salt:
            salt = f"{salt or ''}|user:{req.cache_salt}"
        tt = TokenIdText(self.tokenizer) if req.return_tokens_as_token_ids else self.token_text
        job = await generate.start(self.loop, req, prompts, model, self.default_max_tokens, salt, tt)
        if req.stream:
            return generate.AbortingStream(self.loop, job)
        return await generate.respond(self.loop, job, request)

    def _check_params(self, req) -> None:
        """What only this engine can check of a parsed request (400 naming the field)."""
        bad_id = next((t for t in req.params.stop_token_ids if t >= self.vocab_size), None)
        if bad_id is not None:
            raise APIError(400, f"stop token id {brief(bad_id)} is outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids", code="invalid_value", reason="out_of_vocabulary")
        self._check_budget(req.params.kv_budget_tokens)

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


def decode_leg_transfers(body: dict) -> list[dict]:
    """The ``kv_transfer_params`` a decode leg's body would pull with, one per prompt (several
    prompts get ids ``T.0``, ``T.1``, ...: :func:`pagedkv.server.generate.start`); [] for any
    other body."""
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, dict) or not kv.get("do_remote_prefill") or not isinstance(kv.get("transfer_id"), str):
        return []
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)
    if not several:
        return [kv]
    return [{**kv, "transfer_id": f"{kv['transfer_id']}.{i}"} for i in range(len(prompt))]


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

    install_error_handlers(app, on_api_error=server.count_refusal)
    server.guards.install(app, on_refuse=lambda: server.metrics.reject("unauthorized"))
    return app
