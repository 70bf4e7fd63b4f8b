"""OpenAI-compatible HTTP server with Prometheus metrics (``pagedkv serve``).

- :mod:`engine_loop` — one thread owns the LLMEngine; handlers add/abort through a queue
  and receive outputs through per-request asyncio queues (continuous batching across
  connections).
- :mod:`protocol` — request bodies checked into dataclasses; OpenAI-style errors.
- :mod:`generate` — fan-out, streaming (SSE) and collecting; aborts on disconnect.
- :mod:`responses` — response and chunk bodies, text deltas, logprobs.
- :mod:`metrics` — the Prometheus registry behind ``/metrics``.
- :mod:`app` — the FastAPI routes, auth, body limit, error handlers.
- :mod:`host_guard` — Host/Origin checks against browsers when no API key is set.
- :mod:`http_limits` — read deadlines and a connection cap against slow clients.
- :mod:`cli` — the ``serve`` subcommand.
"""

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str):
    # lazy: ``pagedkv.cli`` imports ``pagedkv.server.cli`` for every command, and other
    # commands should not pay for importing FastAPI and uvicorn
    if name in __all__:
        from pagedkv.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'pagedkv.server' has no attribute {name!r}")
