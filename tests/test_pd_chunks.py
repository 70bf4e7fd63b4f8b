"""How a KV pull's pages travel (issue 16, `connectors/pd/chunks.py`): the chunk plan, and
the three ways pages go (straight from cache to cache, gathered on the producer into a run
received straight into the consumer's cache, staged at both ends), each token-identical to
colocated decoding, with checksums that catch corruption on every path and a producer that
stalls part-way ending in a recompute, a rebuilt link and every page free."""

from __future__ import annotations

import time

import pytest
from test_disaggregated import all_free, close, colocated, decode, drain, make_pair, prefill, prompt_of, reference  # noqa: F401

from pagedkv.connectors.pd import chunks as pd_chunks
from pagedkv.connectors.pd.chunks import plan_chunks, valid_plan
from pagedkv.connectors.pd.pages import PageLayout


class _Layout:  # what plan_chunks reads of a PageLayout
    def __init__(self, page_bytes: int, num_tensors: int) -> None:
        self.page_bytes, self.tensors = page_bytes, [None] * num_tensors


def test_plan_sorts_destinations_and_cuts_runs():
    layout = _Layout(page_bytes=1 << 20, num_tensors=4)  # a run goes straight from 1 page (256 KiB pieces)
    order, chunks = plan_chunks([9, 8, 7, 3, 4, 20], layout)
    assert [[9, 8, 7, 3, 4, 20][k] for k in order] == [3, 4, 7, 8, 9, 20]
    assert chunks == [[2, False], [3, False], [1, False]]
    assert valid_plan(order, chunks, 6, layout)


def test_short_runs_are_staged_and_staged_chunks_are_bounded(monkeypatch):
    monkeypatch.setattr(pd_chunks, "MIN_PIECE_BYTES", 256 << 10)
    layout = _Layout(page_bytes=4 << 20, num_tensors=64)  # 64 KiB pieces: a run needs 4 pages to go straight
    dst = [0, 1, 2, 3, 4] + list(range(10, 40, 2))  # one run of 5, then 15 lone pages
    order, chunks = plan_chunks(dst, layout)
    most = pd_chunks.max_chunk_pages(layout)  # 8 pages of 4 MiB
    assert chunks[0] == [5, False] and all(st for _, st in chunks[1:])
    assert [n for n, _ in chunks[1:]] == [most, 15 - most]
    assert sorted(order) == list(range(len(dst))) and valid_plan(order, chunks, len(dst), layout)


@pytest.mark.parametrize("order, chunks", [
    ([0, 0, 1], [[3, False]]),              # not a permutation
    ([0, 1, 2], [[2, False]]),              # does not add up
    ([0, 1, 2], [[3, "yes"]]),              # not a bool
    ([0, 1, 2], [[0, False], [3, False]]),  # an empty chunk
    ([0, 1, 2], [[3, True]]),               # a staged chunk over the staging size
    ("012", [[3, False]]),
])
def test_the_producer_refuses_a_bad_plan(order, chunks):
    layout = _Layout(page_bytes=16 << 20, num_tensors=2)  # 2 pages fill a staging buffer
    assert not valid_plan(order, chunks, 3, layout)


def _fragment(engine, n_tokens: int) -> None:
    """Run and finish one plain request, so the pool hands its pages out again in
    descending order (the next prompt's pages are then not consecutive upward)."""
    out = colocated(engine, prompt_of(n_tokens, base=9000))
    assert out.error is None


@pytest.mark.parametrize("path", ["cache-to-cache", "gathered", "staged"])
def test_each_path_is_token_identical(tiny_model_dir, reference, monkeypatch, path):
    if path != "staged":
        monkeypatch.setattr(pd_chunks, "MIN_PIECE_BYTES", 1)  # every run goes straight to the cache
    calls = {"gather_one": 0, "gather": 0, "scatter": 0}
    for name in calls:
        def spy(self, *a, _name=name, _f=getattr(PageLayout, name)):
            calls[_name] += 1
            return _f(self, *a)
        monkeypatch.setattr(PageLayout, name, spy)
    p, d = make_pair(tiny_model_dir, prefix_caching=False)
    try:
        if path == "gathered":
            _fragment(p, 400)  # pages 1-26, given back in descending order behind 27-63
            _fragment(p, 450)  # pages 27-55: the free list now starts 56-63, 26, 25, ...
        for i, n in enumerate((200, 40)):
            prompt, tid = prompt_of(n, base=4000 + 300 * i), f"{path}-{n}"
            prefill(p, prompt, tid)
            out = decode(d, prompt, tid)
            drain(p)
            assert out.error is None and out.token_ids == colocated(reference, prompt).token_ids
        assert d.runner.connector.num_failed_pulls == 0 and d.runner.connector.num_pulled_blocks == 13 + 3
        assert all_free(p, d)
        copies = {"cache-to-cache": (0, 0, 0), "gathered": (1, 0, 0), "staged": (0, 1, 1)}[path]
        assert tuple(min(1, v) for v in calls.values()) == copies, calls
    finally:
        close(p, d)


@pytest.mark.parametrize("direct", [True, False])
def test_corruption_is_caught_on_the_straight_path_too(tiny_model_dir, reference, monkeypatch, direct):
    if direct:
        monkeypatch.setattr(pd_chunks, "MIN_PIECE_BYTES", 1)
    p, d = make_pair(tiny_model_dir, prefix_caching=False, producer_kw={"kv_fault_injection": True})
    try:
        prompt = prompt_of(100, base=5000)
        prefill(p, prompt, "c", "corrupt")
        out = decode(d, prompt, "c")
        assert out.error is None and out.token_ids == colocated(reference, prompt).token_ids
        assert d.runner.connector.num_failed_pulls == 1 and d.scheduler.num_kv_load_failures == 1
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_a_producer_stalling_part_way_drops_the_link_and_the_prompt_is_recomputed(
        tiny_model_dir, reference, monkeypatch):
    monkeypatch.setattr(pd_chunks, "MIN_PIECE_BYTES", 1)  # receives posted straight into the cache
    p, d = make_pair(tiny_model_dir, prefix_caching=False,
                     producer_kw={"kv_fault_injection": True, "kv_timeout_s": 1.0}, consumer_kw={"kv_timeout_s": 1.0})
    try:
        prompt = prompt_of(100, base=6000)
        prefill(p, prompt, "s", "stall")
        t0 = time.monotonic()
        out = decode(d, prompt, "s")
        assert time.monotonic() - t0 < 5
        assert out.error is None and out.token_ids == colocated(reference, prompt).token_ids
        assert d.runner.connector.num_failed_pulls == 1
        drain(p)
        assert all_free(p, d)
        # the link comes back, and the next transfer goes through
        assert d.runner.connector.link.ready.wait(15) and p.runner.connector.link.ready.wait(15)
        prompt = prompt_of(60, base=6500)
        prefill(p, prompt, "after")
        out = decode(d, prompt, "after")
        assert out.error is None and out.token_ids == colocated(reference, prompt).token_ids
        assert d.runner.connector.num_failed_pulls == 1 and d.runner.connector.num_pulled_blocks == 4
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)


def test_both_ends_count_their_transfers_in_metrics(tiny_model_dir, reference):
    from pagedkv.server.metrics import ServerMetrics

    p, d = make_pair(tiny_model_dir, prefix_caching=False, producer_kw={"kv_fault_injection": True},
                     consumer_kw={"kv_timeout_s": 2.0})
    try:
        for i, fault in enumerate((None, "corrupt")):
            prompt = prompt_of(40, base=7000 + 100 * i)
            prefill(p, prompt, f"m{i}", fault)
            assert p.stats().kv_transfer["leases"] == 1
            decode(d, prompt, f"m{i}")
            drain(p)
        sp, sd = p.stats().kv_transfer, d.stats().kv_transfer
        assert (sp["role"], sd["role"]) == ("producer", "consumer") and sp["link_up"] and sd["link_up"]
        assert sp["leases"] == 0 and sp["pulls_ok"] == 2 and sd["pulls_ok"] == 1 and sd["pulls_failed"] == 1
        assert sp["blocks"] == 2 * 3 and sd["blocks"] == 3 and sd["bytes"] == sp["bytes"] // 2 > 0
        text = ServerMetrics(d.stats).render().decode()
        assert 'pagedkv_kv_transfer_pulls_total{outcome="failed",role="consumer"} 1.0' in text
        assert 'pagedkv_kv_transfer_link_up{role="consumer"} 1.0' in text
        assert "pagedkv_kv_transfer" not in ServerMetrics(reference.stats).render().decode()
    finally:
        close(p, d)


def test_refused_pulls_leave_nothing_posted_and_keep_the_link(tiny_model_dir, reference, monkeypatch):
    monkeypatch.setattr(pd_chunks, "MIN_PIECE_BYTES", 1)
    p, d = make_pair(tiny_model_dir, prefix_caching=False)
    try:
        link, generation = d.runner.connector.link, d.runner.connector.link.generation
        for i in range(5):  # never prefilled: the producer answers "unknown"
            prompt = prompt_of(100, base=8000 + 200 * i)
            assert decode(d, prompt, f"none-{i}").token_ids == colocated(reference, prompt).token_ids
        assert d.runner.connector.num_failed_pulls == 5
        assert link._late == [] and link.generation == generation and link.ready.is_set()
        assert all_free(p, d)
    finally:
        close(p, d)


def test_a_slow_producer_holds_the_decode_step_at_most_kv_timeout(tiny_model_dir, reference, monkeypatch):
    from pagedkv.connectors.pd.kv_link import KVLink

    monkeypatch.setattr(pd_chunks, "MIN_PIECE_BYTES", 1)  # many messages per pull
    send = KVLink.isend_raw

    def slow(self, tag, *tensors):  # every message arrives, each late, none past the per-message limit
        if self.rank == 0:
            time.sleep(0.3)
        return send(self, tag, *tensors)

    monkeypatch.setattr(KVLink, "isend_raw", slow)
    p, d = make_pair(tiny_model_dir, prefix_caching=False, producer_kw={"kv_timeout_s": 5.0},
                     consumer_kw={"kv_timeout_s": 1.0})
    try:
        prompt = prompt_of(100, base=9500)
        prefill(p, prompt, "slow")
        t0 = time.monotonic()
        out = decode(d, prompt, "slow")
        assert time.monotonic() - t0 < 4  # one 1 s deadline for the pull (per message: ~18 s), then computed here
        assert out.token_ids == colocated(reference, prompt).token_ids
        assert d.runner.connector.num_failed_pulls == 1
        drain(p)
        assert all_free(p, d)
    finally:
        close(p, d)
