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
        r = httpx.post(proxy.url + "/v1/completions", content=b"[1, 2]", timeout=30)
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
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
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
        return b"".join([c async for c in _relay(Cut(), events)])

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
