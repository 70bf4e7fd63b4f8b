"""Layer-by-layer KV push (``kv_send_type`` ``PUT_ASYNC``, issue 16): the producer sends each
layer's pages of each prefill chunk while the prompt computes; the consumer copies them from
its push buffer instead of pulling. Checked: token-identical output to a colocated engine
around block edges (prompts in several chunks, so part-filled blocks are pushed twice), that
the pages really came from the pushes, and that every way a push can fail (no room, a bad
checksum, a decode leg for another prompt, pushes the consumer never took) falls back to the
pull or to local compute with both sides' pages all back."""

from __future__ import annotations

import time

import pytest
from test_disaggregated import (  # noqa: F401
    _cfg,
    all_free,
    check_lengths,
    close,
    colocated,
    decode,
    drain,
    make_pair,
    prefill,
    prompt_of,
    reference,
)

from pagedkv import SamplingParams
from pagedkv.config.engine import EngineConfig

PUSH = {"kv_send_type": "PUT_ASYNC"}


def pushed_done(d, tid, timeout=10.0) -> bool:
    """Wait until the consumer holds ``tid``'s finished pushes (the test then knows the
    decode leg finds them, as a proxy's round trip usually lets it)."""
    buf, deadline = d.runner.connector.pushed, time.monotonic() + timeout
    while time.monotonic() < deadline:
        with buf.cond:
            e = buf.entries.get(tid)
            if e is not None and (e.done is not None or e.dropped):
                return not e.dropped
        time.sleep(0.01)
    return False


def stats(engine) -> dict:
    return engine.runner.connector.transfer_stats()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_pushed_pages_give_the_colocated_output(tiny_model_dir, reference, prefix_caching):
    # 24-token chunks: a 200-token prompt is pushed in 9 chunks, most ending inside a block
    p, d = make_pair(tiny_model_dir, prefix_caching, producer_kw=PUSH, max_num_batched_tokens=24)
    try:
        assert d.runner.connector.link.peer_pushes
        def arrived(d, tid):
            assert pushed_done(d, tid), tid

        check_lengths(p, d, reference, (2, 15, 16, 17, 33, 200), f"push-{prefix_caching}", arrived)
        s = stats(d)
        assert s["pulls_ok"] == 0 and s["pulls_failed"] == 0  # every prompt came from the pushes
        # (with prefix caching the 16-token prompt is a local hit)
        assert s["push_hits"] == (5 if prefix_caching else 6)
        assert s["bytes"] > 0
        from pagedkv.server.metrics import ServerMetrics
        hits = s["push_hits"]
        consumer, producer = ServerMetrics(d.stats).render().decode(), ServerMetrics(p.stats).render().decode()
        assert f'pagedkv_kv_transfer_pushes_total{{outcome="hit",role="consumer"}} {hits}.0' in consumer
        assert 'pagedkv_kv_transfer_pushes_total{outcome="sent",role="producer"}' in producer
        assert s["push_buffer_bytes"] == 0 and not d.runner.connector.pushed.entries
        sp = stats(p)
        assert sp["pushes"] > 0 and sp["pulls_ok"] == 0 and sp["bytes"] == sp["push_bytes"] > 0
        # every page the consumer loaded was pushed (part-filled ones again with their next chunk)
        if not prefix_caching:
            assert sp["push_blocks"] > s["blocks"]
    finally:
        close(p, d)


def test_pages_are_pushed_while_the_prompt_still_computes(tiny_model_dir, reference):
    """The point of pushing: after the first of a long prompt's chunks, its layers are on
    their way before the prefill ends (every layer of that chunk arrives, no done yet)."""
    p, d = make_pair(tiny_model_dir, False, producer_kw=PUSH, max_num_batched_tokens=32)
    try:
        prompt = prompt_of(200, base=1200)
        p.add_request(prompt, SamplingParams(max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "transfer_id": "early"}), "r")
        p.step()  # the first 32 tokens: two blocks of every layer
        buf, layers, deadline = d.runner.connector.pushed, p.runner.storage.num_layers, time.monotonic() + 10
        while time.monotonic() < deadline and len(getattr(buf.entries.get("early"), "parts", ())) < layers:
            time.sleep(0.01)
        entry = buf.entries["early"]
        assert sorted(layer for layer, *_ in entry.parts) == list(range(layers)) and entry.done is None
        assert p.has_unfinished_requests()  # the prefill is not over
        while "r" in p.scheduler.requests:  # the rest of the prompt
            p.step()
        assert pushed_done(d, "early")
        assert decode(d, prompt, "early").token_ids == colocated(reference, prompt).token_ids
        assert stats(d)["push_hits"] == 1 and stats(d)["pulls_ok"] == 0
        drain(p)
    finally:
        close(p, d)


def test_several_choices_of_one_prompt_take_the_same_pushes(tiny_model_dir, reference):
    p, d = make_pair(tiny_model_dir, False, producer_kw=PUSH, max_num_batched_tokens=24)
    try:
        prompt = prompt_of(50, base=1300)
        prefill(p, prompt, "n2")
        assert pushed_done(d, "n2")
        params = {"do_remote_prefill": True, "transfer_id": "n2"}
        for rid in ("a", "b"):  # one prompt's n = 2 choices: the same transfer, scheduled in one step
            d.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                 kv_transfer_params=params), rid)
        t0, outs = time.monotonic(), {}
        while len(outs) < 2:
            outs.update({o.request_id: o for o in d.step() if o.finished})
        assert time.monotonic() - t0 < 3  # the second choice did not wait for pushes already taken
        ref = colocated(reference, prompt).token_ids
        assert outs["a"].token_ids == ref and outs["b"].token_ids == ref
        s = stats(d)  # one transfer taken once, its pages written for each choice
        assert s["push_hits"] == 1 and s["pulls_ok"] == 0 and s["blocks"] == 2 * 4
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_pushed_pages_are_the_pages_a_pull_gets(tiny_model_dir):
    """Byte for byte: the same prompt once pushed, once pulled, into two consumers' pages."""
    p, d = make_pair(tiny_model_dir, False, producer_kw=PUSH, max_num_batched_tokens=24)
    try:
        prompt = prompt_of(90, base=1500)
        prefill(p, prompt, "a")
        assert pushed_done(d, "a")
        pushed = _decoded_pages(d, prompt, "a")
        d.runner.connector.link.peer_pushes = False  # this consumer stops taking pushes:
        d.runner.connector.pushed.capacity = 0       # the next transfer is pulled
        prefill(p, prompt, "b")
        pushed_done(d, "b")
        pulled = _decoded_pages(d, prompt, "b")
        assert stats(d)["pulls_ok"] == 1 and stats(d)["push_hits"] == 1
        assert all(a.equal(b) for a, b in zip(pushed, pulled))
        drain(p)
    finally:
        close(p, d)


def _decoded_pages(d, prompt, tid) -> list:
    """The consumer's K/V pages of ``prompt``'s first 88 tokens (5 whole blocks) right after the load."""
    d.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": tid}), f"r-{tid}")
    d.step()
    pages = d.kv_manager.get_block_ids(f"r-{tid}")[0][:5]
    out = [t[pages].clone() for layer in range(d.runner.storage.num_layers)
           for t in d.runner.storage.page_tensors(layer)]
    drain(d)
    return out


@pytest.mark.parametrize("case", ["no room", "corrupt push", "corrupt both"])
def test_a_failed_push_falls_back_to_the_pull(tiny_model_dir, reference, case):
    consumer = {"kv_timeout_s": 2.0} | ({"kv_buffer_size": 1000} if case == "no room" else {})
    p, d = make_pair(tiny_model_dir, False, producer_kw=PUSH | {"kv_fault_injection": True},
                     consumer_kw=consumer, max_num_batched_tokens=24)
    try:
        prompt = prompt_of(70, base=2500)
        fault = {"no room": None, "corrupt push": "corrupt_push", "corrupt both": "corrupt"}[case]
        prefill(p, prompt, "t", fault)
        assert not pushed_done(d, "t", timeout=3.0)  # dropped
        t0 = time.monotonic()
        out = decode(d, prompt, "t")
        assert time.monotonic() - t0 < 4
        assert out.error is None and out.token_ids == colocated(reference, prompt).token_ids
        s = stats(d)
        assert s["pushes_dropped"] == 1 and s["push_hits"] == 0 and s["push_misses"] == 1
        if case == "corrupt both":  # the pull is corrupt too: computed here
            assert s["pulls_failed"] == 1 and d.scheduler.num_kv_load_failures == 1
        else:
            assert s["pulls_ok"] == 1 and s["pulls_failed"] == 0
        drain(p)
        assert all_free(p, d) and d.runner.connector.pushed.nbytes == 0
    finally:
        close(p, d)


def test_pushes_for_another_prompt_or_never_taken_are_dropped(tiny_model_dir, reference):
    p, d = make_pair(tiny_model_dir, False, producer_kw=PUSH | {"kv_lease_s": 1.0})
    try:
        prefill(p, prompt_of(40, base=5000), "t")
        assert pushed_done(d, "t")
        other = prompt_of(40, base=6000)  # the same transfer id, another prompt: not these pages
        assert decode(d, other, "t").token_ids == colocated(reference, other).token_ids
        s = stats(d)
        assert s["push_misses"] == 1 and s["pulls_failed"] == 1  # the producer refused the pull too
        prefill(p, prompt_of(40, base=7000), "orphan")  # no decode leg comes: dropped with the lease
        assert pushed_done(d, "orphan")
        time.sleep(1.1)
        prefill(p, prompt_of(20, base=8000), "later")
        assert pushed_done(d, "later")
        assert "orphan" not in d.runner.connector.pushed.entries
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_a_producer_that_pushes_with_a_lost_consumer_gives_up(tiny_model_dir, reference):
    p, d = make_pair(tiny_model_dir, False, producer_kw=PUSH, max_num_batched_tokens=24)
    try:
        d.close()  # the link drops: the prefill computes and pushes nothing, holding nothing
        deadline = time.monotonic() + 10
        while p.runner.connector.link.ready.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        out = prefill(p, prompt_of(60, base=9000), "t")
        assert out.error is None and stats(p)["pushes"] == 0
        drain(p)
        assert all_free(p)
    finally:
        close(p)


def test_send_type_and_buffer_size_are_checked():
    for bad, match in (({"kv_send_type": "PUT"}, "kv_send_type must be"),
                       ({"kv_buffer_size": -1}, "kv_buffer_size"), ({"kv_buffer_size": "1GB"}, "kv_buffer_size")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(kv_transfer_config=_cfg("kv_producer", 1, **bad))


def test_proxy_over_a_pushing_prefill_server(tiny_model_dir):
    """``pagedkv serve --kv-transfer-config '{..., "kv_send_type": "PUT_ASYNC"}'`` in a process
    of its own, behind ``pagedkv proxy``: the answer (one choice and two) is a colocated
    server's, and the decode instance took the prompts from the pushes, not by pulling."""
    from test_disaggregated_serve import complete, free_port, serve_here, serve_process, text_of, wait_free

    from pagedkv.server.live import LiveServer
    from pagedkv.server.proxy import build_proxy

    engine, srv = serve_here(tiny_model_dir)
    try:
        expected = text_of(complete(srv.url))
        expected_long = text_of(complete(srv.url, prompt="one two three " * 60))
    finally:
        srv.stop()
    kv_port = free_port()
    prefill, p_url = serve_process(tiny_model_dir, "kv_producer", kv_port, "--max-num-batched-tokens", "32",
                                   kv_send_type="PUT_ASYNC")
    decode, d_srv = serve_here(tiny_model_dir, "kv_consumer", kv_port)
    proxy = LiveServer(build_proxy(p_url, d_srv.url, timeout=30)).start()
    try:
        assert decode.runner.connector.link.ready.wait(30)
        assert text_of(complete(proxy.url)) == expected
        assert text_of(complete(proxy.url, stream=True)) == expected
        assert text_of(complete(proxy.url, prompt="one two three " * 60)) == expected_long  # several chunks
        r = complete(proxy.url, n=2)
        assert r.status_code == 200 and [c["text"] for c in r.json()["choices"]] == [expected] * 2
        s = decode.runner.connector.transfer_stats()
        assert s["push_hits"] == 4 and s["pulls_ok"] == 0 and s["pulls_failed"] == 0, s  # (n = 2: one transfer)
        wait_free(decode, 5)
    finally:
        proxy.stop()
        d_srv.stop()
        prefill.kill()


def test_a_reused_transfer_id_keeps_the_first_prompts_pages(tiny_model_dir, reference):
    """A client (not the proxy) reuses a transfer id for another prompt before the first's
    decode leg: the second is not pushed (as its lease is refused), the first's pushes stand."""
    p, d = make_pair(tiny_model_dir, False, producer_kw=PUSH | {"kv_lease_s": 2.0}, max_num_batched_tokens=32)
    try:
        a, b = prompt_of(64, base=3000), prompt_of(64, base=7000)
        params = SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "transfer_id": "dup"})
        p.add_request(a, params, "pa")
        p.add_request(b, params, "pb")
        for _ in range(3):  # a's two chunks (its lease taken), then b's first
            p.step()
        assert pushed_done(d, "dup")
        time.sleep(0.3)
        assert decode(d, a, "dup").token_ids == colocated(reference, a).token_ids
        assert stats(d)["push_hits"] == 1
        drain(p, 15)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_a_decode_leg_is_not_held_when_no_pushes_are_coming(tiny_model_dir, reference):
    """Never prefilled, or the prefill aborted after its first chunk: the decode leg pulls (or
    computes) at once, not after waiting out half of kv_timeout_s."""
    p, d = make_pair(tiny_model_dir, False, producer_kw=PUSH, consumer_kw={"kv_timeout_s": 10.0},
                     max_num_batched_tokens=32)
    try:
        prompt = prompt_of(80, base=4400)
        ref = colocated(reference, prompt).token_ids
        t0 = time.monotonic()
        assert decode(d, prompt, "never").token_ids == ref
        assert time.monotonic() - t0 < 2
        for tid in ("never-a", "never-b", "never-c"):  # legs of one step share one short grace
            d.add_request(prompt, SamplingParams(max_tokens=1, kv_transfer_params={
                "do_remote_prefill": True, "transfer_id": tid}), tid)
        t0 = time.monotonic()
        d.step()
        assert time.monotonic() - t0 < 0.7
        drain(d)
        p.add_request(prompt, SamplingParams(max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "transfer_id": "aborted"}), "pr")
        p.step()  # its first chunk, pushed
        p.abort_request("pr")
        time.sleep(0.3)
        t0 = time.monotonic()
        assert decode(d, prompt, "aborted").token_ids == ref
        assert time.monotonic() - t0 < 2
        drain(p)
        assert all_free(p, d) and d.runner.connector.pushed.nbytes == 0
    finally:
        close(p, d)


def test_pushes_no_decode_leg_took_are_forgotten_while_idle(tiny_model_dir):
    p, d = make_pair(tiny_model_dir, False, producer_kw=PUSH | {"kv_lease_s": 1.0})
    try:
        prefill(p, prompt_of(40, base=4600), "orphan")
        assert pushed_done(d, "orphan")
        buf, deadline = d.runner.connector.pushed, time.monotonic() + 6
        while buf.entries and time.monotonic() < deadline:  # the consumer takes no step meanwhile
            time.sleep(0.1)
        assert not buf.entries and buf.nbytes == 0
        drain(p)
    finally:
        close(p, d)


def test_layer_pushes_after_their_transfer_ended_are_counted_late():
    """Pushes arriving for a transfer already released (or taken) are thrown away and
    counted as pushes_late, so sent = received + late on a link that lost nothing."""
    from pagedkv.connectors.pd.push_buffer import PushBuffer

    buf = PushBuffer(1 << 20, lease_s=5.0)
    buf.release("t")  # e.g. a max_tokens 0 request whose decode leg never takes its pushes
    data = buf.pool.take(64)
    buf.receive({"transfer_id": "t", "layer": 0, "first_block": 1, "digest": 0}, data)
    buf.receive({"transfer_id": "t", "op": "pushed"}, None)  # the done message carries no layer
    assert buf.counts["pushes_late"] == 1 and buf.counts["pushes_received"] == 0 and "t" not in buf.entries
