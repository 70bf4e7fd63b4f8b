"""The KV connector seam, exercised by a test connector that offloads full pages to a dict
(keyed by block hash) as they are written and loads them back for later requests: loaded
KV gives bit-identical tokens and log-probs, a failed load is recomputed, and a delayed
free holds pages until the worker reports the transfer done."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pagedkv import SamplingParams
from pagedkv.config.engine import EngineConfig
from pagedkv.connectors.base import KVConnector, KVConnectorScheduler, KVConnectorWorker
from pagedkv.engine.engine import LLMEngine
from pagedkv.kv.hashing import encode_extra_keys, hash_blocks

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPT = list(range(500, 540))  # 40 tokens: 2 full pages of 16 can be offloaded


@dataclass
class Meta:
    loads: list[tuple[int, bytes]] = field(default_factory=list)  # (page, block hash)
    saves: list[tuple[int, bytes]] = field(default_factory=list)


class DictScheduler(KVConnectorScheduler):
    def __init__(self, delay_free: bool = False) -> None:
        self.stored: set[bytes] = set()
        self.delay_free = delay_free
        self._local: dict[str, int] = {}
        self._loads: list[tuple[int, bytes]] = []
        self.engine: LLMEngine | None = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        bs, hashes = self.engine.kv_manager.block_size, self.engine.kv_manager.block_hashes(request)
        k = num_computed_tokens // bs
        while k < len(hashes) and hashes[k] in self.stored:
            k += 1
        self._local[request.request_id] = num_computed_tokens
        return k * bs - num_computed_tokens

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        bs, hashes = self.engine.kv_manager.block_size, self.engine.kv_manager.block_hashes(request)
        first = self._local.pop(request.request_id, 0) // bs  # not asked: a prompt-logprobs request
        for k in range(first, first + num_external_tokens // bs):
            self._loads.append((block_ids[0][k], hashes[k]))

    def request_finished(self, request, block_ids) -> bool:
        return self.delay_free

    def build_connector_meta(self, out) -> Meta:
        meta, self._loads = Meta(self._loads), []
        for new in out.scheduled_new_reqs:
            self._plan_saves(meta, new.req_id, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id])
        c = out.scheduled_cached_reqs
        for rid, start in zip(c.req_ids, c.num_computed_tokens):
            self._plan_saves(meta, rid, start, out.num_scheduled_tokens[rid])
        return meta

    def _plan_saves(self, meta: Meta, rid: str, start: int, n: int) -> None:
        kv, req = self.engine.kv_manager, self.engine.requests[rid]
        hashes, table = kv.block_hashes(req), kv.get_block_ids(rid)[0]
        for k in range(start // kv.block_size, (start + n) // kv.block_size):
            if hashes[k] not in self.stored:
                meta.saves.append((table[k], hashes[k]))
                self.stored.add(hashes[k])


class DictWorker(KVConnectorWorker):
    def __init__(self) -> None:
        self.store: dict[bytes, dict[int, tuple]] = {}
        self.corrupt: set[bytes] = set()  # hashes whose next load fails
        self.failed: set[int] = set()
        self.events: list[str] = []

    def start_load_kv(self, storage) -> None:
        self.failed = set()
        for page, h in self.metadata.loads:
            if h in self.corrupt:
                self.corrupt.discard(h)
                self.failed.add(page)
                continue
            for layer, (k, v) in self.store[h].items():
                storage.k[layer][page].copy_(k)
                storage.v[layer][page].copy_(v)
            self.events.append("load")

    def save_kv_layer(self, layer: int, storage, attn_metadata) -> None:
        for page, h in self.metadata.saves:
            self.store.setdefault(h, {})[layer] = (storage.k[layer][page].clone(), storage.v[layer][page].clone())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(finished_req_ids), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.failed


def make(tiny_model_dir, delay_free=False) -> tuple[LLMEngine, DictScheduler, DictWorker]:
    sched, worker = DictScheduler(delay_free), DictWorker()
    cfg = EngineConfig(model=str(tiny_model_dir), num_blocks=32, batch_invariant=True, debug_invariants=True)
    engine = LLMEngine(cfg, kv_connector=KVConnector(sched, worker))
    sched.engine = engine
    return engine, sched, worker


def run(engine: LLMEngine, prompt=PROMPT, on_step=None):
    rid = engine.add_request({"prompt_token_ids": prompt}, PARAMS).request_id
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                final = o
        if on_step:
            on_step(engine)
    return final


@pytest.fixture(scope="module")
def cold(tiny_model_dir):
    engine, _, _ = make(tiny_model_dir)
    return run(engine)


def test_pages_loaded_by_the_connector_give_identical_outputs(tiny_model_dir, cold):
    engine, sched, worker = make(tiny_model_dir)
    first = run(engine)
    assert len(worker.store) == 2 and first.num_cached_tokens == 0   # 2 full prompt pages saved
    engine.reset_prefix_cache()                                      # the local cache forgets them
    again = run(engine)
    assert worker.events == ["load"] * 2 and again.num_cached_tokens == 32
    assert (again.token_ids, again.logprobs) == (cold.token_ids, cold.logprobs)
    assert engine.kv_manager.usage().used == 0


def test_a_failed_load_is_recomputed(tiny_model_dir, cold):
    engine, sched, worker = make(tiny_model_dir)
    run(engine)
    engine.reset_prefix_cache()
    worker.corrupt = {hash_blocks(PROMPT, 16, encode_extra_keys(engine.kv_manager.extra_keys))[1]}  # the 2nd page
    out = run(engine)
    assert engine.scheduler.num_kv_load_failures == 1
    assert (out.token_ids, out.logprobs) == (cold.token_ids, cold.logprobs)


def test_delayed_free_holds_pages_until_the_worker_reports(tiny_model_dir, cold):
    engine, sched, worker = make(tiny_model_dir, delay_free=True)
    held = []
    out = run(engine, on_step=lambda e: held.append((e.scheduler.num_delayed_free, e.kv_manager.usage().used)))
    assert out.finish_reason == "length" and (out.token_ids, out.logprobs) == (cold.token_ids, cold.logprobs)
    i = next(i for i, (delayed, _) in enumerate(held) if delayed)
    assert held[i][1] > 0                 # finished, pages still held for the connector
    assert held[-1] == (0, 0)             # reported done on the next step, then freed
    engine.kv_manager.check_invariants()



def test_an_id_whose_pages_the_connector_holds_cannot_be_reused(tiny_model_dir):
    engine, _, _ = make(tiny_model_dir, delay_free=True)
    engine.add_request({"prompt_token_ids": PROMPT}, PARAMS, request_id="A")
    while "A" in engine.requests:
        engine.step()
    assert engine.scheduler.num_delayed_free == 1
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request({"prompt_token_ids": PROMPT[:20]}, PARAMS, request_id="A")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request({"prompt_token_ids": PROMPT[:20]}, PARAMS, request_id="A")  # released: fine now


def test_prompt_logprobs_requests_are_not_served_by_the_connector(tiny_model_dir):
    engine, _, worker = make(tiny_model_dir)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    rid = engine.add_request({"prompt_token_ids": PROMPT}, params).request_id
    first = None
    while engine.has_unfinished_requests():
        first = next((o for o in engine.step() if o.request_id == rid and o.finished), first)
    engine.reset_prefix_cache()
    rid = engine.add_request({"prompt_token_ids": PROMPT}, params).request_id
    again = None
    while engine.has_unfinished_requests():
        again = next((o for o in engine.step() if o.request_id == rid and o.finished), again)
    assert worker.events == [] and again.num_cached_tokens == 0
    assert again.prompt_logprobs == first.prompt_logprobs and again.prompt_logprobs.count(None) == 1


def test_a_failed_load_does_not_shift_a_seeded_request(tiny_model_dir):
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    engine, _, worker = make(tiny_model_dir)

    def go():
        rid = engine.add_request({"prompt_token_ids": PROMPT}, seeded).request_id
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
        engine.reset_prefix_cache()
        return out.token_ids

    cold = go()
    worker.corrupt = {hash_blocks(PROMPT, 16, encode_extra_keys(engine.kv_manager.extra_keys))[1]}
    assert go() == cold and engine.scheduler.num_kv_load_failures == 1
