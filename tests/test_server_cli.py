"""``serve`` as a user runs it: a subprocess with the real default model on a free
loopback port; the openai client; SIGTERM with requests in flight (one finishes within
the drain time, one is aborted) and a clean exit 0; one-line errors for bad flags."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from pagedkv.server.__main__ import main as serve_main

SERVE = [sys.executable, "-m", "pagedkv.server"]


def _run(args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(SERVE + args, capture_output=True, text=True, timeout=timeout)


def test_help_has_examples():
    r = _run(["--help"])
    assert r.returncode == 0
    for text in ("examples:", "--api-key", "--host", "--allowed-hosts", "--limit-concurrency",
                 "--served-model-name", "--max-body-bytes",
                 "--kv-cache-memory", "curl http://127.0.0.1:8000"):
        assert text in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-body-bytes", "lots"], "cannot parse size"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
    (["--torch-threads", "0"], "--torch-threads must be >= 1"),
    (["--limit-concurrency", "-1"], "--limit-concurrency must be >= 0"),
    (["--allowed-hosts", " , "], "--allowed-hosts takes comma-separated host names"),
    (["--allowed-hosts", "a.lan,[::1"], "--allowed-hosts takes comma-separated host names"),
    (["--served-model-name", "a", ""], "--served-model-name takes non-empty names"),
    (["--api-key", " padded "], "must not start or end with whitespace"),
    (["--api-key", ""], "an API key must not be empty"),
])
def test_bad_flags_exit_2_with_one_line(args, message, capsys):
    assert serve_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_busy_port_fails_before_loading_the_model(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert serve_main(["--port", str(s.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1" in err and "loading" not in err


class ServeProcess:
    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(SERVE + ["--port", "0", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(120) or self.url is None:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.url = m.group(1)
                self.ready.set()
        self.ready.set()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.slow
def test_real_model_chat_and_graceful_sigterm():
    srv = ServeProcess("--kv-cache-memory", "64MiB", "--torch-threads", "1", "--shutdown-timeout", "3",
                       "--log-level", "warning")
    try:
        c = srv.client()
        r = c.chat.completions.create(model="smollm2-135m-instruct", max_tokens=12, temperature=0,
                                      messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"

        results, started = {}, {name: threading.Event() for name in ("short", "long")}

        def stream(name: str, max_tokens: int) -> None:
            reasons, text = [], ""
            for ch in c.completions.create(model="smollm2-135m-instruct", prompt="Once upon a time",
                                           max_tokens=max_tokens, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}):
                started[name].set()
                text += ch.choices[0].text
                reasons.append(ch.choices[0].finish_reason)
            results[name] = (reasons[-1], text)

        threads = [threading.Thread(target=stream, args=a) for a in (("short", 8), ("long", 1000))]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started.values())
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert srv.proc.wait(30) == 0, "".join(srv.lines)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert results["short"][0] == "length"    # finished within the drain time
    assert results["long"][0] == "abort"      # cut at the drain time, ended cleanly with [DONE]
    assert "Traceback" not in "".join(srv.lines)


def _connect_when_listening(port: int, timeout: float = 60) -> socket.socket:
    """The socket is bound (and the URL printed) before uvicorn listens on it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_sigterm_exits_within_the_shutdown_timeout_with_a_client_stuck_mid_upload(tiny_model_dir):
    """A client that stalls mid-body must not hold the exit past --shutdown-timeout, and
    the exit logs no traceback (uvicorn used to cancel the handler after a margin)."""
    srv = ServeProcess("--model", str(tiny_model_dir), "--num-blocks", "16", "--shutdown-timeout", "1",
                       "--log-level", "warning", "--served-model-name", "tiny", "tiny-2", "--served-model-name", "t3",
                       "tiny")
    port = int(srv.url.rsplit(":", 1)[1])
    try:
        stuck = _connect_when_listening(port)
        models = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]  # vLLM's nargs="+" names
        assert [m["id"] for m in models] == ["tiny", "tiny-2", "t3"]
        stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.3)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, "".join(srv.lines)
        took = time.monotonic() - t0
        stuck.close()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert took < 3.0, took
    assert "Traceback" not in "".join(srv.lines) and "Cancel" not in "".join(srv.lines)
