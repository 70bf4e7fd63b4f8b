"""LiveServer: an app served by uvicorn in a background thread on a loopback port.

For tests and benchmarks that want a real HTTP server without a subprocess::

    with LiveServer(build_app(engine, ServerConfig(["m"]))) as srv:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
"""

from __future__ import annotations

import threading
import time

from pagedkv.server.cli import bind_socket, uvicorn_server
from pagedkv.server.http_limits import HTTPLimits


class LiveServer:
    """Serves ``app`` (from ``build_app``) on ``host:port`` (0 = a free port) until ``stop()``
    or the ``with`` ends, as ``pagedkv serve`` does: ``limits`` on each connection, and a
    stop drains for ``shutdown_timeout`` seconds, then aborts what is left.

    Raises:
        OSError: the address cannot be bound.
        RuntimeError: the server did not start within ``start_timeout`` seconds.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 start_timeout: float = 30.0, shutdown_timeout: float = 10.0,
                 limits: HTTPLimits = HTTPLimits()) -> None:
        self.sock = bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn_server(app, shutdown_timeout, limits, log_level=log_level)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="pagedkv-live-server", daemon=True)
        self.start_timeout = start_timeout

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "LiveServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
