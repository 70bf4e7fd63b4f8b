"""Disaggregated prefill/decode through ``pagedkv serve`` and ``pagedkv proxy`` (issue 16):
the proxy's answer equals a colocated server's, streamed or not, and a killed prefill or
decode process ends every request correctly or with a clear error in bounded time, with
the surviving instance's pages all free afterwards."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.server.app import ServerConfig, build_app
from pagedkv.server.live import LiveServer
from pagedkv.server.proxy import build_proxy

JSON_TYPE = {"Content-Type": "application/json"}
PROMPT = "The quick brown fox jumps over the lazy dog and then runs far away into the dark forest"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_cfg(role: str, port: int, **extra) -> dict:
    return {"kv_connector": "TorchDistConnector", "kv_role": role, "kv_port": port, "kv_lease_s": 3.0,
            "kv_timeout_s": 3.0, **extra}


def serve_process(model_dir, role: str, kv_port: int, *args: str, **extra) -> tuple[subprocess.Popen, str]:
    """``pagedkv serve`` in a process of its own; returns it and its URL once healthy."""
    import json
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from pagedkv.cli import main; sys.exit(main())", "serve",
           "--model", str(model_dir), "--port", str(port), "--num-blocks", "64", "--served-model-name", "tiny",
           "--kv-transfer-config", json.dumps(kv_cfg(role, kv_port, **extra)), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def serve_here(model_dir, role: str | None = None, kv_port: int = 0):
    engine = LLMEngine(model=str(model_dir), num_blocks=64,
                       kv_transfer_config=kv_cfg(role, kv_port) if role else None)
    return engine, LiveServer(build_app(engine, ServerConfig(["tiny"]))).start()


def complete(url: str, stream=False, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": stream, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("text/event-stream"):
        import json
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        return "".join(c["choices"][0]["text"] for c in chunks)
    return r.json()["choices"][0]["text"]


def wait_free(engine, timeout: float) -> float:
    t0 = time.monotonic()
    while engine.kv_manager.pool.num_used:
        assert time.monotonic() - t0 < timeout, f"{engine.kv_manager.pool.num_used} pages still held"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    engine, srv = serve_here(tiny_model_dir)
    try:
        yield text_of(complete(srv.url))
    finally:
        srv.stop()


def test_proxy_answers_as_a_colocated_server_and_survives_a_killed_prefill(tiny_model_dir, expected):
    kv_port = free_port()
    prefill, p_url = serve_process(tiny_model_dir, "kv_producer", kv_port)
    decode, d_srv = serve_here(tiny_model_dir, "kv_consumer", kv_port)
    proxy = LiveServer(build_proxy(p_url, d_srv.url, timeout=30)).start()
    try:
        assert decode.runner.connector.link.ready.wait(30)
        assert text_of(complete(proxy.url)) == expected
        assert text_of(complete(proxy.url, stream=True)) == expected
        assert decode.runner.connector.num_pulled_blocks > 0 and decode.runner.connector.num_failed_pulls == 0
        assert httpx.get(proxy.url + "/health").status_code == 200
        # the prefill leg done, then the prefill process dies before the decode leg pulls
        leg = complete(p_url, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "k"})
        assert leg.status_code == 200
        prefill.send_signal(signal.SIGKILL)
        prefill.wait(10)
        t0 = time.monotonic()
        r = complete(d_srv.url, kv_transfer_params={"do_remote_prefill": True, "transfer_id": "k"})
        assert text_of(r) == expected and time.monotonic() - t0 < 10  # computed here
        assert text_of(complete(proxy.url)) == expected  # the proxy skips the dead prefill instance
        assert httpx.get(proxy.url + "/health").status_code == 503
        wait_free(decode, 5)
    finally:
        proxy.stop()
        d_srv.stop()
        if prefill.poll() is None:
            prefill.kill()


def test_a_killed_decode_process_frees_the_producer_and_the_client_gets_an_error(tiny_model_dir):
    kv_port = free_port()
    prefill, p_srv = serve_here(tiny_model_dir, "kv_producer", kv_port)
    decode, d_url = serve_process(tiny_model_dir, "kv_consumer", kv_port)
    proxy = LiveServer(build_proxy(p_srv.url, d_url, timeout=30)).start()
    try:
        deadline = time.monotonic() + 30
        while not prefill.runner.connector.link.ready.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        leg = complete(p_srv.url, max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "k"})
        assert leg.status_code == 200 and prefill.kv_manager.pool.num_used > 0  # leased for the decode instance
        decode.send_signal(signal.SIGKILL)
        decode.wait(10)
        assert wait_free(prefill, 5) < 3  # the lost link ends every lease at once, not after kv_lease_s
        t0 = time.monotonic()
        r = complete(proxy.url)
        assert r.status_code == 502 and "decode instance" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10
        wait_free(prefill, 5)
    finally:
        proxy.stop()
        p_srv.stop()
        if decode.poll() is None:
            decode.kill()


def test_proxy_passes_a_refused_prefill_leg_back(tiny_model_dir):
    kv_port = free_port()
    prefill, p_srv = serve_here(tiny_model_dir, "kv_producer", kv_port)
    decode, d_srv = serve_here(tiny_model_dir, "kv_consumer", kv_port)
    proxy = LiveServer(build_proxy(p_srv.url, d_srv.url)).start()
    try:
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
        assert r.status_code == 404 or r.status_code == 400
        assert r.json()["error"]["param"] == "model"
        r = httpx.post(proxy.url + "/v1/completions", content=b"[1, 2]", timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        assert prefill.kv_manager.pool.num_used == 0 and decode.kv_manager.pool.num_used == 0
    finally:
        for s in (proxy, d_srv, p_srv):
            s.stop()


def test_choices_and_prompt_lists_each_get_their_transfer_and_a_leaving_client_aborts(tiny_model_dir):
    """n > 1 and a list of prompts under the fail policy (a missed transfer would be an
    error); then a client that leaves a non-streamed request: the decode leg is aborted."""
    import json
    kv_port = free_port()
    cfg = kv_cfg("kv_consumer", kv_port) | {"kv_load_failure_policy": "fail"}
    prefill, p_srv = serve_here(tiny_model_dir, "kv_producer", kv_port)
    decode = LLMEngine(model=str(tiny_model_dir), num_blocks=64, kv_transfer_config=cfg)
    d_srv = LiveServer(build_app(decode, ServerConfig(["tiny"]))).start()
    proxy = LiveServer(build_proxy(p_srv.url, d_srv.url)).start()
    try:
        assert decode.runner.connector.link.ready.wait(30) and prefill.runner.connector.link.ready.wait(30)
        r = complete(proxy.url, n=2, temperature=0.8, seed=1)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        r = complete(proxy.url, prompt=[PROMPT, PROMPT + " again"])
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert decode.runner.connector.num_failed_pulls == 0 and decode.runner.connector.num_pulled_blocks >= 3
        r = complete(proxy.url, prompt=[PROMPT * 20, PROMPT], max_tokens=400)  # the first is too long for the consumer
        assert r.status_code == 400
        assert wait_free(prefill, 2.5) < 2.5  # both prompts' leases released, not left to run out (3 s)
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 450, "ignore_eos": True}).encode()
        with socket.create_connection((proxy.host, proxy.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 10
            while not decode.scheduler.running:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        wait_free(decode, 5)  # the client left: the decode leg was closed and its request aborted
        wait_free(prefill, 5)
    finally:
        for s in (proxy, d_srv, p_srv):
            s.stop()


def test_a_decode_leg_cut_mid_stream_ends_with_an_error_event():
    """The consumer dying mid-stream: whole events pass, a cut-off one is dropped, then an
    error event and [DONE] (a single failing server's ending), not a broken chunked body."""
    import asyncio
    import json

    import httpx

    from pagedkv.server.proxy import _relay

    class Cut:
        async def aiter_raw(self):
            yield b'data: {"a": 1}\n\ndata: {"b"'
            yield b': 2}\n\ndata: {"c": 3'
            raise httpx.RemoteProtocolError("peer closed connection")

    async def collect(events):
        return b"".join([c async for c in _relay(Cut(), events, asyncio.Event())])

    body = asyncio.run(collect(True)).decode()
    events = [e for e in body.split("\n\n") if e]
    assert events[:2] == ['data: {"a": 1}', 'data: {"b": 2}'] and events[-1] == "data: [DONE]"
    assert json.loads(events[2].removeprefix("data: "))["error"]["code"] == "decode_failed" and len(events) == 4
    assert asyncio.run(collect(False)) == b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: {"c": 3'  # other bodies: as sent


def test_a_hung_producer_is_skipped_after_its_health_times_out(tiny_model_dir, expected):
    """A producer that accepts connections but never answers (stopped, wedged) costs a request
    LIVENESS_S, not the proxy's --timeout: the decode instance computes the prompt."""
    import asyncio

    from fastapi import FastAPI

    from pagedkv.server import proxy as proxy_mod

    hung = FastAPI()

    @hung.get("/health")
    @hung.post("/v1/completions")
    async def never():
        await asyncio.sleep(60)

    p_srv = LiveServer(hung).start()
    engine, d_srv = serve_here(tiny_model_dir)
    proxy = LiveServer(build_proxy(p_srv.url, d_srv.url, timeout=30)).start()
    try:
        t0 = time.monotonic()
        assert text_of(complete(proxy.url)) == expected
        assert time.monotonic() - t0 < proxy_mod.LIVENESS_S + 5
    finally:
        for s in (proxy, d_srv, p_srv):
            s.stop()


# ---- issue 51: the proxy keeps the server's promises -------------------------------------------
def test_the_proxy_checks_a_body_as_the_server_does_before_either_leg():
    """A body the decode instance would refuse is refused by the proxy itself (the server's
    own parser), so no prefill leg leaves pages leased for it: with nothing listening behind
    the proxy, bad bodies get the server's 400, and only a valid one reaches for a leg (502)."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = LiveServer(build_proxy(dead, dead, timeout=5)).start()
    try:
        for bad, param in (({"max_tokens": -1}, "max_tokens"), ({"n": 9}, "n"), ({"temperature": -1}, "temperature"),
                           ({"logprobs": 99}, "logprobs")):
            r = httpx.post(proxy.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", **bad}, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        r = httpx.post(proxy.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = httpx.post(proxy.url + "/v1/completions", content=b'{"prompt": "hi"}', timeout=10,
                       headers={"Content-Type": "text/plain"})
        assert r.status_code == 415
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10)
        assert r.status_code == 502 and r.json()["error"]["code"] == "decode_unavailable"
    finally:
        proxy.stop()


def test_the_proxy_refuses_big_bodies_before_reading_them():
    """A 30 MB body: 413 from the Content-Length, and while streaming one without it (the
    proxy read it whole before: +260 MB resident, then a 502)."""
    import resource

    dead = f"http://127.0.0.1:{free_port()}"
    proxy = LiveServer(build_proxy(dead, dead, timeout=5)).start()
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        big = b'{"prompt": "' + b"x" * (30 << 20) + b'"}'
        r = httpx.post(proxy.url + "/v1/completions", content=big, timeout=30, headers=JSON_TYPE)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():
            for _ in range(30):
                yield b" " * (1 << 20)
        r = httpx.post(proxy.url + "/v1/completions", content=chunked(), timeout=30, headers=JSON_TYPE)
        assert r.status_code == 413
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert grown_mb < 100, grown_mb  # (the test's own 30 MB body is the most of it)
    finally:
        proxy.stop()


def test_a_keyed_proxy_needs_the_key_and_any_host_then_works(tiny_model_dir, expected):
    from pagedkv.server.guards import GuardConfig

    engine, srv = serve_here(tiny_model_dir)
    proxy = LiveServer(build_proxy(srv.url, srv.url, timeout=30, guard=GuardConfig(api_keys=("sk-proxy",)))).start()
    try:
        assert complete(proxy.url).status_code == 401
        assert httpx.get(proxy.url + "/v1/models").status_code == 401
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer sk-proxy", "Host": "api.example.com"})
        assert text_of(r) == expected
    finally:
        proxy.stop()
        srv.stop()


def _leases(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pagedkv_kv_transfer_leases"):
            return float(line.split()[-1])
    raise AssertionError("no leases gauge")


def test_a_decode_leg_the_consumer_refuses_releases_the_producers_pages_at_once(tiny_model_dir):
    """Issue 51: a decode leg refused before the engine sees it (a bad field, an unknown
    model) releases its transfer at once: the producer's leases are back to 0 within a
    second (the gauge refreshes once a second on an idle server), not after ``kv_lease_s`` (60 s)."""
    import uuid

    kv_port = free_port()
    producer = LLMEngine(model=str(tiny_model_dir), num_blocks=64,
                         kv_transfer_config=kv_cfg("kv_producer", kv_port, kv_lease_s=60.0))
    p_srv = LiveServer(build_app(producer, ServerConfig(["tiny"]))).start()
    consumer, d_srv = serve_here(tiny_model_dir, "kv_consumer", kv_port)
    try:
        assert consumer.connector.worker.link.ready.wait(30)
        for bad in ({"max_tokens": -1}, {"n": 9}, {"model": "nope"}, {"prompt": ["a", "b"], "max_tokens": -1}):
            tid = uuid.uuid4().hex
            prompts = bad.get("prompt", "one two three " * 20)
            for i, prompt in enumerate(prompts if isinstance(prompts, list) else [prompts]):
                leg = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params":
                       {"do_remote_decode": True, "transfer_id": f"{tid}.{i}" if isinstance(prompts, list) else tid}}
                assert httpx.post(p_srv.url + "/v1/completions", json=leg, timeout=30).status_code == 200
            t0 = time.monotonic()
            while _leases(p_srv.url) < 1:
                assert time.monotonic() - t0 < 5
                time.sleep(0.05)
            r = httpx.post(d_srv.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": prompts, **{k: v for k, v in bad.items() if k != "prompt"},
                "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": tid}})
            assert r.status_code in (400, 404), r.text
            t0 = time.monotonic()
            while _leases(p_srv.url) > 0:
                assert time.monotonic() - t0 < 2.0, f"{bad}: the producer still leases {_leases(p_srv.url)}"
                time.sleep(0.05)
        wait_free(producer, 5)
    finally:
        d_srv.stop()
        p_srv.stop()


def _ticker_app():
    """A stand-in decode instance whose completions stream one event every 0.1 s, forever."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def ticks():
        async def events():
            for i in range(10**6):
                yield f'data: {{"tick": {i}}}\n\n'.encode()
                await asyncio.sleep(0.1)
        return StreamingResponse(events(), media_type="text/event-stream")
    return app


def test_the_proxy_stops_within_its_shutdown_timeout_and_ends_streams_with_an_error():
    """Issue 51: SIGTERM with a stream in flight: the proxy gives it ``--shutdown-timeout``
    seconds (as ``pagedkv serve`` does), then ends it with an error event and ``[DONE]`` and
    exits (it waited a fixed 5 s drain plus uvicorn's 30 s hard stop, and cut the stream)."""
    import json
    import threading

    decode = LiveServer(_ticker_app()).start()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from pagedkv.cli import main; sys.exit(main())",
                             "proxy", "--prefill", f"http://127.0.0.1:{free_port()}", "--decode", decode.url,
                             "--port", str(port), "--shutdown-timeout", "1"], stderr=subprocess.DEVNULL)
    url, lines = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)

        def read():
            with httpx.stream("POST", url + "/v1/completions", json={"prompt": "hi", "stream": True},
                              timeout=30) as r:
                lines.extend(line for line in r.iter_lines() if line)
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        stopped = time.monotonic() - t0
        reader.join(10)
        assert 1.0 <= stopped < 5, stopped
        assert lines[-1] == "data: [DONE]" and sum(line.startswith('data: {"tick"') for line in lines) >= 15
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    finally:
        if proc.poll() is None:
            proc.kill()
        decode.stop()


def test_a_decode_leg_whose_connection_closes_unanswered_is_sent_again():
    """Issue 51: the consumer closing a connection before answering (an idle keep-alive one,
    after a pause) made the proxy answer 502; the leg now goes once more, on a new one."""
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    seen = []

    def serve():
        for i in range(2):
            conn, _ = srv.accept()
            conn.recv(65536)
            seen.append(i)
            if i == 1:
                body = b'{"id": "x", "choices": []}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    decode = f"http://127.0.0.1:{srv.getsockname()[1]}"
    proxy = LiveServer(build_proxy(f"http://127.0.0.1:{free_port()}", decode, timeout=10)).start()
    try:
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["id"] == "x" and seen == [0, 1]
    finally:
        proxy.stop()
        srv.close()
