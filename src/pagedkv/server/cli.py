"""``pagedkv serve``: the OpenAI-compatible server on one engine.

The socket is bound before the model loads, so a busy port fails in a second, not after
the load. SIGINT/SIGTERM shut down gracefully: no new connections, in-flight requests get
``--shutdown-timeout`` seconds to finish, then what is left is aborted (its blocks freed),
connections still uploading a request are closed, and the command exits 0. Slow clients
get read deadlines and a connection cap (:mod:`pagedkv.server.http_limits`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
import threading

# after the drain + abort: time for the engine step in flight to end, then uvicorn cancels what hangs
HARD_STOP_MARGIN_S = 30.0

SERVE_EXAMPLES = """examples:
  pagedkv serve                                  # smollm2-135m-instruct on http://127.0.0.1:8000
  pagedkv serve --port 8080 --kv-cache-memory 1GiB --max-num-seqs 64
  PAGEDKV_API_KEY=sk-mine pagedkv serve          # Bearer auth (the env var keeps the key out of ps)
  pagedkv serve --api-key sk-team-a --api-key sk-team-b   # two tenants, one prefix cache each
  pagedkv serve --host 0.0.0.0 --api-key sk-mine # listen on every interface (use a key!)
  pagedkv serve --allowed-hosts gpu-box.lan      # no key: also accept Host gpu-box.lan

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'
  curl http://127.0.0.1:8000/metrics

SIGINT/SIGTERM: stop accepting, let in-flight requests finish (--shutdown-timeout),
abort the rest, exit 0.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` on an ``argparse`` subparsers object; ``func`` returns an exit code."""
    from pagedkv.cli_common import add_engine_args
    from pagedkv.server.guards import add_guard_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics",
                              description="Serve the engine over the OpenAI API: /v1/completions, "
                              "/v1/chat/completions, /v1/models, vLLM's /tokenize, /detokenize and "
                              "/tokenizer_info, /health, /metrics.",
                              epilog=SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port; 0 = any free one (default: %(default)s)")
    g.add_argument("--served-model-name", nargs="+", action="extend", default=None, metavar="NAME",
                   help="model name(s) clients use, as in vLLM; the first is reported (default: --model)")
    g.add_argument("--shared-prefix-cache", action="store_true",
                   help="share prefix-cache blocks across API keys (default: one cache per key, so one "
                   "tenant's timings cannot reveal another's prompts)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before they are "
                   "aborted (default: %(default)s)")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice). On a small, shared CPU, 1 "
                   "makes batched decoding much faster: the per-sequence attention ops are tiny")
    add_guard_args(p.add_argument_group("security and limits (as pagedkv proxy's)"))
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log one line per HTTP request (default: on)")
    add_engine_args(p)
    p.set_defaults(func=run_serve)
    return p


def run_serve(a: argparse.Namespace) -> int:
    try:
        return _serve(a)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _serve(a: argparse.Namespace) -> int:
    from pagedkv.cli_common import engine_kwargs
    from pagedkv.config.engine import EngineConfig
    from pagedkv.server.guards import guard_config, is_loopback

    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    if a.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {a.shutdown_timeout}")
    guards = guard_config(a)
    names = list(dict.fromkeys(a.served_model_name or [a.model]))  # repeated names listed once
    if any(not n.strip() for n in names):
        raise ValueError("--served-model-name takes non-empty names")
    sock = bind_socket(a.host, a.port)
    host, port = sock.getsockname()[:2]
    if not guards.api_keys and not is_loopback(a.host):
        print(f"warning: listening on {a.host} without --api-key: anyone who can reach it can use it "
              "(requests must name a loopback host or one in --allowed-hosts)", file=sys.stderr)

    from pagedkv.engine.engine import LLMEngine
    from pagedkv.model.weight_formats import describe
    from pagedkv.server.app import ServerConfig, build_app

    if a.torch_threads is not None:
        if a.torch_threads < 1:
            raise ValueError(f"--torch-threads must be >= 1, got {a.torch_threads}")
        import torch

        torch.set_num_threads(a.torch_threads)
    print(f"pagedkv: loading {a.model} ...", file=sys.stderr, flush=True)
    engine = LLMEngine(EngineConfig(**engine_kwargs(a)))
    from pagedkv.kernels.cpu.ops import prepare_kernel

    if engine.model.device.type == "cpu":
        prepare_kernel()  # a first build (about a minute) happens now, not inside a request's engine step
    app = build_app(engine, ServerConfig(names, guards, not a.shared_prefix_cache))
    freeze_long_lived()
    s = engine.stats()
    shown = f"[{host}]" if ":" in host else host
    print(f"pagedkv: serving {names[0]} on http://{shown}:{port} ({s.num_blocks} KV blocks of "
          f"{s.block_size} tokens = {s.num_blocks * s.block_size} tokens, {s.kv_cache_bytes / 2**20:.0f} MiB; "
          f"max_model_len {engine.max_model_len}; weights {a.weight_dtype}: {describe(engine.model)}"
          f"{_tiers(s)}{_spec(engine)}; auth {'on' if guards.api_keys else 'off'})", file=sys.stderr, flush=True)
    uvicorn_server(app, a.shutdown_timeout, guards.limits, log_level=a.log_level,
                   access_log=a.access_log).run(sockets=[sock])
    return 0


def freeze_long_lived() -> None:
    """Move every object alive now (the engine's modules, tables and tokenizer, the app) out
    of the cyclic collector's view, as vLLM's engine core does after start-up. The server
    holds ~300,000 of them for its whole life, and each full collection walked them all:
    one engine in a process (SmolLM2, int8 activations, AMD EPYC) paused 110-125 ms in a
    full collection within 1,024 decoded tokens, stalling every stream
    (``benchmarks/bench_gc_pauses.py``).
    Reference counting still frees them; the collector still runs on what requests allocate."""
    import gc

    gc.collect()
    gc.freeze()


def uvicorn_server(app, drain_s: float, limits, **config):
    """The uvicorn Server for ``app`` (built by ``build_app``, or the proxy's): ``limits`` (an
    :class:`~pagedkv.server.http_limits.HTTPLimits`) on every connection, and the graceful
    shutdown of :func:`graceful_server`. ``config``: more ``uvicorn.Config`` keywords."""
    import uvicorn

    config = uvicorn.Config(app, lifespan="on", timeout_graceful_shutdown=drain_s + HARD_STOP_MARGIN_S,
                            **limits.uvicorn_kwargs(), **config)
    server = getattr(app.state, "server", None)
    if server is not None:
        return graceful_server(config, server.loop.abort_all, drain_s, on_begin=server.loop.begin_drain)
    if hasattr(app.state, "abort_all"):  # the proxy: no engine, its own in-flight legs
        return graceful_server(config, app.state.abort_all, drain_s, on_begin=app.state.begin_drain)
    return uvicorn.Server(config)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (uvicorn listens on it). Raises OSError naming the address."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def graceful_server(config, abort_all, drain_s: float, on_begin=lambda: None):
    """uvicorn's Server that, once shutdown starts, gives in-flight requests ``drain_s``
    seconds and then calls ``abort_all`` (streams end with finish_reason 'abort' and
    ``[DONE]``, waiting non-streaming calls get 503), instead of cutting connections. It
    does not re-raise the caught signal afterwards (that would turn a clean SIGTERM stop
    into death by signal). At ``drain_s`` it also closes connections whose client is still
    sending its request or has stopped reading its response (either would otherwise hold
    the exit until uvicorn cancels its task). ``on_begin()`` runs as shutdown starts (the
    engine loop shortens its steps). uvicorn is imported lazily: other commands do not pay for it."""
    import uvicorn

    from pagedkv.server.http_limits import cut_stalled

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            on_begin()
            asyncio.get_running_loop().call_later(drain_s, self.end_drain)
            await super().shutdown(sockets)

        def end_drain(self) -> None:
            abort_all()
            cut_stalled(self.server_state.connections)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return Server(config)


def _spec(engine) -> str:
    """``; speculative decoding: ngram, k drafts`` (``draft_model <model>``) for the ready line, if on."""
    c = engine.config.speculative_config
    if c is None:
        return ""
    method = f"draft_model {c.model}" if c.method == "draft_model" else c.method
    return f"; speculative decoding: {method}, {c.num_speculative_tokens} drafts"


def _tiers(stats) -> str:
    """``; KV tiers: cpu N blocks, disk M blocks (K found)`` for the ready line, if any."""
    o = stats.kv_offload
    if not o:
        return ""
    disk = (f", disk {o['disk_capacity_blocks']:,} blocks ({o['disk_blocks_used']:,} found)"
            if o["disk_capacity_blocks"] else "")
    return f"; KV tiers: cpu {o['capacity_blocks']:,} blocks{disk}"
