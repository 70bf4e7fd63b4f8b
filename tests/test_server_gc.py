"""``pagedkv serve`` takes its start-up objects out of the cyclic collector's view."""

from __future__ import annotations

import gc

from pagedkv.cli import main
from pagedkv.server import cli as server_cli


def test_serve_freezes_what_start_up_built(monkeypatch):
    class Server:  # stands in for uvicorn: records that serving began, returns at once
        ran = False

        def run(self, sockets):
            Server.ran = bool(sockets)

    monkeypatch.setattr(server_cli, "uvicorn_server", lambda *a, **k: Server())
    gc.unfreeze()
    try:
        assert main(["serve", "--host", "127.0.0.1", "--port", "0", "--num-blocks", "64"]) == 0
        # the engine (modules, tables, tokenizer) and the app: far more than pytest's own objects
        assert Server.ran and gc.get_freeze_count() > 50_000
        young = len(gc.get_objects())
        assert young < gc.get_freeze_count() // 10  # the collector now walks only what came after
    finally:
        gc.unfreeze()
