"""Disaggregated prefill/decode (issue 16): a producer and a consumer engine joined by the
TorchDistConnector's gloo link (two engines in this process, the link's threads between
them), against one colocated engine: token-identical greedy output for prompt lengths
around block edges with prefix caching on and off, and a fault matrix where every case ends
correctly (or with a clear error under ``fail``) and both sides have every page back."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.config.engine import EngineConfig
from pagedkv.engine.engine import LLMEngine

PORTS = itertools.count(14700)
LENGTHS = (1, 15, 16, 17, 33, 200)  # block size 16: around its edges, and a long one


def _cfg(role: str, port: int, **kw) -> dict:
    return {"kv_connector": "TorchDistConnector", "kv_role": role, "kv_port": port, **kw}


def make_pair(model_dir, prefix_caching=True, producer_kw=None, consumer_kw=None, **engine_kw):
    port = next(PORTS)
    kw = dict(model=str(model_dir), num_blocks=64, enable_prefix_caching=prefix_caching, debug_invariants=True)
    kw.update(engine_kw)
    p = LLMEngine(**kw, kv_transfer_config=_cfg("kv_producer", port, **(producer_kw or {})))
    d = LLMEngine(**kw, kv_transfer_config=_cfg("kv_consumer", port, **(consumer_kw or {})))
    assert d.runner.connector.link.ready.wait(30) and p.runner.connector.link.ready.wait(30)
    return p, d


def close(*engines) -> None:
    for e in engines:
        e.close()


def run(engine, prompt, params, rid):
    engine.add_request(prompt, params, rid)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def drain(engine, timeout=10.0) -> None:
    """Step until no request and no lease holds pages (bounded)."""
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "pages still held"
        engine.step()


def prefill(p, prompt, tid, fault=None):
    params = {"do_remote_decode": True, "transfer_id": tid} | ({"fault": fault} if fault else {})
    return run(p, prompt, SamplingParams(max_tokens=1, temperature=0, kv_transfer_params=params), f"p-{tid}")


def decode(d, prompt, tid, n=8):
    return run(d, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                         kv_transfer_params={"do_remote_prefill": True, "transfer_id": tid}),
               f"d-{tid}")


def colocated(engine, prompt, n=8):
    return run(engine, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), f"c-{next(PORTS)}")


def prompt_of(n: int, base: int = 1000) -> dict:
    return {"prompt_token_ids": list(range(base, base + n))}


def all_free(*engines) -> bool:
    return all(e.kv_manager.pool.num_used == 0 for e in engines)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    e = LLMEngine(model=str(tiny_model_dir), num_blocks=64, enable_prefix_caching=False)
    yield e
    e.close()


def check_lengths(p, d, reference, lengths, tag, before_decode=None) -> None:
    """Each length's prompt prefilled on ``p``, decoded on ``d`` (after ``before_decode(d,
    tid)`` if given): greedy output equal to ``reference``'s, every page free after."""
    for n in lengths:
        prompt, tid = prompt_of(n), f"{tag}-{n}"
        first = prefill(p, prompt, tid)
        if before_decode is not None:
            before_decode(d, tid)
        out = decode(d, prompt, tid)
        drain(p)
        ref = colocated(reference, prompt)
        assert out.error is None and out.token_ids == ref.token_ids, n
        assert first.token_ids == ref.token_ids[:1]
        assert all_free(p, d)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_disaggregated_greedy_equals_colocated(tiny_model_dir, reference, prefix_caching):
    p, d = make_pair(tiny_model_dir, prefix_caching)
    try:
        check_lengths(p, d, reference, LENGTHS, f"len-{prefix_caching}")
        pulled = d.runner.connector.num_pulled_blocks
        assert d.runner.connector.num_failed_pulls == 0
        # prompts share their leading tokens: with prefix caching the consumer pulls only blocks it lacks
        assert pulled < sum((n - 1 + 15) // 16 for n in LENGTHS) if prefix_caching else pulled == 1 + 1 + 1 + 2 + 13
    finally:
        close(p, d)


@pytest.mark.parametrize("fault", ["drop", "delay", "corrupt"])
def test_a_failed_transfer_is_recomputed_and_frees_both_sides(tiny_model_dir, reference, fault):
    p, d = make_pair(tiny_model_dir, producer_kw={"kv_fault_injection": True, "kv_lease_s": 1.0},
                     consumer_kw={"kv_timeout_s": 1.0})
    try:
        prompt = prompt_of(40, base=2000)
        prefill(p, prompt, "t", fault)
        t0 = time.monotonic()
        out = decode(d, prompt, "t")
        assert time.monotonic() - t0 < 5  # bounded by the pull timeout / the lease
        assert out.error is None and out.token_ids == colocated(reference, prompt).token_ids
        assert d.runner.connector.num_failed_pulls == 1 and d.scheduler.num_kv_load_failures == 1
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_fail_policy_ends_the_request_with_a_clear_error(tiny_model_dir):
    p, d = make_pair(tiny_model_dir, producer_kw={"kv_fault_injection": True},
                     consumer_kw={"kv_load_failure_policy": "fail"})
    try:
        prompt = prompt_of(40, base=3000)
        prefill(p, prompt, "t", "corrupt")
        out = decode(d, prompt, "t")
        assert out.finish_reason == "abort" and "kv_load_failure_policy fail" in out.error
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_duplicated_decode_leg_and_unknown_transfer_are_computed_locally(tiny_model_dir, reference):
    p, d = make_pair(tiny_model_dir, prefix_caching=False)
    try:
        prompt = prompt_of(40, base=4000)
        ref = colocated(reference, prompt).token_ids
        prefill(p, prompt, "t")
        assert decode(d, prompt, "t").token_ids == ref
        assert decode(d, prompt, "t").token_ids == ref  # the lease was released: computed here
        assert decode(d, prompt, "never-prefilled").token_ids == ref
        assert d.runner.connector.num_failed_pulls == 2
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_a_decode_leg_for_another_prompt_gets_nothing(tiny_model_dir, reference):
    p, d = make_pair(tiny_model_dir, prefix_caching=False)
    try:
        prefill(p, prompt_of(40, base=5000), "t")
        other = prompt_of(40, base=6000)
        assert decode(d, other, "t").token_ids == colocated(reference, other).token_ids
        assert d.runner.connector.num_failed_pulls == 1  # the producer checked the prompt's hash
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_rejected_or_aborted_decode_legs_free_the_producer(tiny_model_dir):
    p, d = make_pair(tiny_model_dir, producer_kw={"kv_lease_s": 1.0}, max_model_len=64)
    try:
        long = prompt_of(60, base=7000)
        prefill(p, long, "rejected")
        with pytest.raises(ValueError):  # 60 prompt + 8 output > 64: the consumer rejects at once
            d.add_request(long, SamplingParams(max_tokens=8, kv_transfer_params={"do_remote_prefill": True,
                                                                                  "transfer_id": "rejected"}))
        t0 = time.monotonic()
        drain(p)  # the consumer told the producer at once
        assert time.monotonic() - t0 < 0.9 and all_free(p)
        prefill(p, long, "orphan")  # a decode leg that never comes: the lease runs out
        t0 = time.monotonic()
        drain(p)
        assert 0.5 < time.monotonic() - t0 < 5 and all_free(p)
        prompt = prompt_of(40, base=8000)
        prefill(p, prompt, "aborted")
        d.add_request(prompt, SamplingParams(max_tokens=8, kv_transfer_params={"do_remote_prefill": True,
                                                                              "transfer_id": "aborted"}), "r")
        d.abort_request("r")  # before it was scheduled: the consumer releases the lease at its next step
        d.step()
        t0 = time.monotonic()
        drain(p)
        assert time.monotonic() - t0 < 0.9 and all_free(p, d)  # released, not expired
    finally:
        close(p, d)


def test_aborted_prefill_keeps_nothing(tiny_model_dir):
    p, d = make_pair(tiny_model_dir, max_num_batched_tokens=64)
    try:
        p.add_request(prompt_of(200, base=9000), SamplingParams(
            max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t"}), "r")
        p.step()  # a first chunk of 64 tokens
        assert p.kv_manager.pool.num_used == 4
        p.abort_request("r")
        assert not p.has_unfinished_requests() and all_free(p)
    finally:
        close(p, d)


def test_kv_transfer_config_is_checked():
    for bad, match in (('{"kv_role": "kv_producer"}', "needs 'kv_connector'"),
                       ('{"kv_connector": "Nope", "kv_role": "kv_producer"}', "kv_connector must be"),
                       ('{"kv_connector": "TorchDistConnector", "kv_role": "kv_both"}', "kv_role must be"),
                       ('{"kv_connector": "TorchDistConnector", "kv_role": "kv_consumer", "kv_port": 0}', "kv_port"),
                       ('{"kv_connector": "TorchDistConnector", "kv_role": "kv_consumer", "lease": 1}', "unknown key"),
                       ("not json", "not valid JSON")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(kv_transfer_config=bad)
    with pytest.raises(ValueError, match="one KV connector"):
        EngineConfig(kv_transfer_config=_cfg("kv_producer", 1), kv_offload_memory="1MiB")
    with pytest.raises(ValueError, match="kv_transfer_config"):
        EngineConfig(kv_transfer_config=_cfg("kv_producer", 1), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="transfer_id"):
        SamplingParams(kv_transfer_params={"do_remote_prefill": True})
    with pytest.raises(ValueError, match="not one of"):
        SamplingParams(kv_transfer_params={"transfer_id": 3})


def test_a_kv_port_held_by_another_service_is_named_and_retried_slowly():
    """A consumer whose kv_port answers as something else (an HTTP server) says so in one
    line and retries every FOREIGN_RETRY_S, not every second: each try logs torch's stacks."""
    import socket
    import threading

    from pagedkv.config.kv_transfer import KVTransferConfig
    from pagedkv.connectors.pd import kv_link

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    accepted = []

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            accepted.append(time.monotonic())
            try:
                c.recv(100)
                c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            except OSError:
                pass
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    cfg = KVTransferConfig(kv_connector="TorchDistConnector", kv_role="kv_consumer", kv_port=srv.getsockname()[1])
    link = kv_link.KVLink(cfg, "fingerprint").start()
    try:
        deadline = time.monotonic() + kv_link.CONNECT_S + 5
        while "not as a pagedkv prefill" not in link._last_error and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "another service on kv_port" in link._last_error
        first = len(accepted)
        time.sleep(2.0)
        assert len(accepted) == first and not link.ready.is_set()  # waiting, not hammering the port
    finally:
        link.close()
        srv.close()


# ---- issue 51: the link keeps the server's promises ------------------------------------------
def _listening_addresses(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (``/proc/net/tcp`` and
    ``tcp6``: state 0A)."""
    import ipaddress
    import socket as so
    found = set()
    for name, width in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                raw = bytes.fromhex(addr)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per 32-bit word, host order
                found.add(str(ipaddress.ip_address(raw)) if width == 4 else so.inet_ntop(so.AF_INET6, raw))
    return found


def _pair_with_secrets(model_dir, producer_secret, consumer_secret):
    port = next(PORTS)
    kw = dict(model=str(model_dir), num_blocks=64, debug_invariants=True)
    p = LLMEngine(**kw, kv_transfer_config=_cfg("kv_producer", port, **producer_secret))
    d = LLMEngine(**kw, kv_transfer_config=_cfg("kv_consumer", port, **consumer_secret))
    return p, d, port


@pytest.mark.parametrize("producer,consumer,says", [({"kv_secret": "s3cret"}, {}, "does not hold"),
                                                    ({"kv_secret": "s3cret"}, {"kv_secret": "other"}, "different"),
                                                    ({}, {"kv_secret": "s3cret"}, "holds no shared secret")],
                         ids=["consumer-without", "wrong-secret", "producer-without"])
def test_a_peer_without_the_shared_secret_pulls_nothing(tiny_model_dir, caplog, producer, consumer, says):
    """Issue 51: with ``kv_secret`` set, the handshake proves both ends hold it before any
    page moves; a peer without it is refused with one log line, and its decode legs compute
    the prompt themselves (nothing leaves the producer)."""
    p, d, _ = _pair_with_secrets(tiny_model_dir, producer, consumer)
    try:
        link = d.runner.connector.link
        deadline = time.monotonic() + 30
        while link.refused is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.refused is not None and says in link.refused and not link.ready.is_set()
        assert not p.runner.connector.link.ready.is_set()  # it refused too: never "link up"
        prompt = prompt_of(40, base=4100)
        prefill(p, prompt, "s")
        out = decode(d, prompt, "s")
        assert out.token_ids == colocated(p, prompt).token_ids  # computed here, correct
        assert d.stats().kv_transfer["pulls_ok"] == 0 and d.stats().kv_transfer["blocks"] == 0
        assert sum("secret" in r.getMessage() for r in caplog.records if r.levelname == "ERROR") >= 1
    finally:
        close(p, d)


def test_the_shared_secret_links_and_the_store_listens_on_kv_ip_only(tiny_model_dir, monkeypatch, reference):
    monkeypatch.setenv("PAGEDKV_KV_SECRET", "from-the-environment")  # both ends: kept out of `ps`
    p, d, port = _pair_with_secrets(tiny_model_dir, {}, {})
    try:
        assert d.runner.connector.link.ready.wait(30) and p.runner.connector.link.ready.wait(30)
        assert _listening_addresses(port) == {"127.0.0.1"}  # not every interface
        prompt = prompt_of(40, base=4200)
        prefill(p, prompt, "t")
        assert decode(d, prompt, "t").token_ids == colocated(reference, prompt).token_ids
        assert d.stats().kv_transfer["pulls_ok"] == 1
        assert "from-the-environment" not in repr(p.config.kv_transfer_config)
    finally:
        close(p, d)


class _FakeGroup:
    """A process group whose receives fill in ``headers`` one after another."""

    def __init__(self, *headers):
        self.headers, self.allocated = list(headers), []

    def recv(self, tensors, src, tag):
        t = tensors[0]
        if self.headers:
            t.copy_(torch.tensor(self.headers.pop(0), dtype=torch.int64))
        else:
            self.allocated.append(t.numel())
        return type("Work", (), {"wait": lambda self, timeout=None: True})()


@pytest.mark.parametrize("header,limits", [((1 << 40, 0), {}), ((-5, 0), {}), ((100, 1 << 40), {"max_data": 0}),
                                           ((1 << 20, 0), {"max_meta": 64 << 10})],
                         ids=["huge-json", "negative", "hello-with-data", "hello-over-64k"])
def test_a_message_header_is_checked_before_anything_is_allocated(header, limits):
    """Issue 51: a peer (before or after proving anything) that announces a huge or
    negative message gets a LinkError; nothing of that size is allocated."""
    from pagedkv.config.kv_transfer import KVTransferConfig
    from pagedkv.connectors.pd.kv_link import KVLink, LinkError

    link = KVLink(KVTransferConfig(kv_connector="TorchDistConnector", kv_role="kv_producer", kv_port=next(PORTS)),
                  "fingerprint")
    pg = _FakeGroup(header)
    with pytest.raises(LinkError, match="malformed message"):
        link.recv(1, pg=pg, **limits)
    assert pg.allocated == []


def test_leases_give_way_to_a_waiting_prefill(tiny_model_dir, reference):
    """Issue 51: prompts whose leases fill the producer's pool (their decode legs not sent
    yet, as for a request of many prompts) do not hold a new prefill leg for ``kv_lease_s``:
    with nothing else running, leases older than RECLAIM_IDLE_S end early, and those
    prompts' decode legs compute them, correctly."""
    from pagedkv.connectors.pd.producer import RECLAIM_IDLE_S

    p, d = make_pair(tiny_model_dir, prefix_caching=False, producer_kw={"kv_lease_s": 60}, num_blocks=12)
    try:
        held = [(prompt_of(40, base=5000 + 100 * i), f"full-{i}") for i in range(3)]  # 3 pages each: 9 of 12
        for prompt, tid in held:
            prefill(p, prompt, tid)
        assert p.stats().kv_transfer["leases"] == 3
        t = time.monotonic()
        late = prompt_of(60, base=6000)
        prefill(p, late, "late")  # needs 4 pages: only 3 free until a lease ends
        assert time.monotonic() - t < RECLAIM_IDLE_S + 3  # not kv_lease_s
        stats = p.stats().kv_transfer
        assert stats["leases_reclaimed"] == 1 and stats["leases"] == 3  # the oldest gave way; the late one's
        for prompt, tid in held + [(late, "late")]:  # reclaimed or not: the same tokens
            assert decode(d, prompt, tid).token_ids == colocated(reference, prompt).token_ids
        assert d.stats().kv_transfer["pulls_ok"] >= 1  # the late one's lease was pulled
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_a_lease_gives_way_only_once_old_enough():
    """While other requests run, a lease younger than RECLAIM_AFTER_S keeps its pages (its
    decode leg's pull is likely on its way); with nothing running, one RECLAIM_IDLE_S old
    goes; oldest first, only as many as the pages asked for, none while ended ones wait to
    be freed."""
    from pagedkv.connectors.pd.producer import RECLAIM_AFTER_S, RECLAIM_IDLE_S, Lease, LeaseTable

    table = LeaseTable(lease_s=60.0)
    now = time.monotonic()
    for i, age in enumerate((0.2, 0.3, 5.0)):  # expires = start + lease_s
        table.add(f"t{i}", Lease(f"r{i}", [10 * i, 10 * i + 1], [1, 2], now - age + 60.0))
    assert table.reclaim(2, RECLAIM_AFTER_S) == 1 and set(table.leases) == {"t0", "t1"}  # only the 5 s one
    assert table.reclaim(2, RECLAIM_IDLE_S) == 0  # its pages are not freed yet
    assert table.take_ended(0) == {"r2"}
    assert table.reclaim(2, RECLAIM_AFTER_S) == 0  # the rest are young
    assert table.reclaim(1, RECLAIM_IDLE_S) == 1 and set(table.leases) == {"t0"}  # the older of the two
    assert table.reclaimed == 2
