"""The CPU tier beside a GPU's cache (issue 54), on the CPU: the worker that copies pages on
its own streams (:mod:`pagedkv.connectors.offload.device_tier_worker`), checked against a fake
GPU (``fake_streams``: happens-before by vector clocks, a modelled clock) for the ordering a
GPU would rely on, and end to end on the float path (bf16 compute, inline streams) for the
bytes.

Ordering claims: a layer's save never starts before that layer's write; a layer never reads
a page before its load landed; swap-outs read a page before anything writes it again; a
page saved in one step is not written by the next until the save ended; the forward never
waits for a save (saves end behind the later layers and the LM head)."""

from __future__ import annotations

import random

import pytest
import torch
from fake_streams import FakeStreams

from pagedkv import SamplingParams
from pagedkv.connectors.offload.cpu_tier_worker import OffloadMeta
from pagedkv.connectors.offload.device_tier_worker import DeviceOffloadWorker
from pagedkv.connectors.offload.page_moves import slot_runs
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.kv_cache.storage import KVCacheStorage

LAYERS, PAGES, SLOTS = 3, 24, 16
SPEC = KVCacheSpec(num_layers=LAYERS, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)


def test_slot_runs_cover_the_slots_in_order():
    assert slot_runs([4, 5, 6, 9, 2]) == [(4, 0, 3), (9, 3, 1), (2, 4, 1)]
    assert slot_runs([]) == [] and slot_runs([7]) == [(7, 0, 1)]
    rng = random.Random(0)
    for _ in range(100):
        slots = rng.sample(range(40), rng.randint(1, 20))
        flat = [first + i for first, _, n in slot_runs(slots) for i in range(n)]
        assert flat == slots


class _Step:
    """One fake step: the plan, and the pages the forward writes and reads."""

    def __init__(self, meta: OffloadMeta, writes: list[int], reads: list[int], samples: bool = True,
                 save_layers: int = LAYERS) -> None:
        self.meta, self.writes, self.reads, self.samples = meta, writes, reads, samples
        self.save_layers = save_layers  # layers whose save hook runs (a draft model's may not)


class _FakeDisk:
    """Disk records by hash (a number each): ``load`` writes the record's number plus the
    layer into its staging page, as the real disk tier writes a record's bytes."""

    def __init__(self) -> None:
        self.bytes_read, self.corrupt = 0, []

    def load(self, loads, staging, tier) -> set:
        for h, _, page in loads:
            for layer in range(LAYERS):
                _fill(staging, layer, [page], float(int.from_bytes(h, "big")) + layer)
            self.bytes_read += staging.page_size_bytes
        return set()

    def write(self, writes, removes, tier) -> None:
        pass

    def finished(self):
        return [], []

    def close(self) -> None:
        pass


def _record(n: int) -> bytes:
    return n.to_bytes(4, "big")


def _scenario(seed: int, steps: int = 12) -> list[_Step]:
    """Random steps with the hazards a real schedule makes: pages swapped out and reused in
    the same step (by a load or a write), pages saved in one step and written in the next,
    tier slots saved then loaded, slots loaded then saved over; steps that sample no token
    and save nothing (the host does not wait for them)."""
    rng, out, filled, written_before = random.Random(seed), [], set(), []
    for n in range(1, steps + 1):
        meta = OffloadMeta(n)
        if written_before and rng.random() < 0.5:
            outs = rng.sample(written_before, min(len(written_before), rng.randint(1, 3)))
            meta.swap_outs = list(zip(outs, rng.sample(range(SLOTS), len(outs))))
        reuse = [p for p, _ in meta.swap_outs]
        loads_from = [s for s in filled if s not in {t for _, t in meta.swap_outs}]
        if loads_from and rng.random() < 0.7:
            slots = rng.sample(loads_from, min(len(loads_from), rng.randint(1, 3)))
            pages = (reuse + rng.sample(range(1, PAGES), PAGES - 1))
            pages = list(dict.fromkeys(pages))[:len(slots)]
            meta.loads = list(zip(slots, pages))
        loaded = [p for _, p in meta.loads]
        free = [p for p in range(1, PAGES) if p not in loaded]
        writes = list(dict.fromkeys(reuse[:1] + rng.sample(free, rng.randint(1, 4))))
        writes = [p for p in writes if p not in loaded]
        taken = {t for _, t in meta.swap_outs} | {s for s, _ in meta.loads}
        slots = [s for s in range(SLOTS) if s not in taken]
        start = rng.randrange(len(slots))
        quiet = rng.random() < 0.3  # a prefill chunk that fills no block: no save, no token sampled
        saves = [] if quiet else slots[start:start + len(writes)]  # often consecutive slots: runs
        meta.saves = list(zip(writes, saves))
        filled |= set(saves) | {t for _, t in meta.swap_outs}
        written_before = writes
        unused = [p for p in list(dict.fromkeys(reuse + free)) if p not in writes and p not in loaded]
        if unused and rng.random() < 0.4:  # disk records into fresh pages (a swapped-out one first)
            pages = unused[:rng.randint(1, min(3, len(unused)))]
            meta.disk_loads = [(_record(50_000 + 100 * n + i), (), p) for i, p in enumerate(pages)]
        from_disk = [p for _, _, p in meta.disk_loads]
        out.append(_Step(meta, writes, loaded + from_disk + rng.sample(range(1, PAGES), 2), samples=not quiet))
    return out


def _fill(storage: KVCacheStorage, layer: int, pages: list[int], value: float) -> None:
    for t in storage.page_tensors(layer):
        t[pages] = value + torch.arange(len(pages), dtype=t.dtype).view(-1, *[1] * (t.dim() - 1))


def _run(worker: DeviceOffloadWorker, fs: FakeStreams, storage: KVCacheStorage, steps: list[_Step],
         layer_s: float = 1.0, head_s: float = 1.0, tier_expect: dict | None = None) -> dict:
    """Drive ``worker`` as the runner does; returns the expected tier contents by slot
    (the first page tensor's first element per layer), starting from ``tier_expect``."""
    tier_expect = dict(tier_expect or {})
    for step in steps:
        meta = step.meta
        worker.bind_connector_metadata(meta)
        for p, s in meta.swap_outs:
            for layer in range(LAYERS):
                tier_expect[(layer, s)] = storage.page_tensors(layer)[0][p].flatten()[0].item()
        worker.start_load_kv(storage)
        hooks = worker.needs_layer_hooks()  # no: the runner may replay a CUDA graph, which calls none
        for layer in range(LAYERS):
            if hooks:
                worker.wait_for_layer_load(layer)
            value = 1000.0 * meta.step + 100 * layer
            fs.launch(fs.compute, lambda layer=layer, value=value: _fill(storage, layer, step.writes, value),
                      reads=[("device", layer, p) for p in step.reads],
                      writes=[("device", layer, p) for p in step.writes], cost=layer_s, label=f"layer {layer}")
            for p, s in meta.saves if layer < step.save_layers else ():
                tier_expect[(layer, s)] = value + step.writes.index(p)
            if layer < step.save_layers and hooks:
                worker.save_kv_layer(layer, storage, None)
        fs.launch(fs.compute, lambda: None, cost=head_s, label="head")
        if step.samples:
            fs.synchronize(fs.record(fs.compute))  # the sampled tokens come back to the host
        worker.wait_for_save()
        assert worker.get_connector_output()[1]
        worker.clear_connector_metadata()
        for s, p in meta.loads:
            for layer in range(LAYERS):
                assert storage.page_tensors(layer)[0][p].flatten()[0].item() == tier_expect[(layer, s)]
        for h, _, p in meta.disk_loads:
            if p not in step.writes:
                for layer in range(LAYERS):
                    assert storage.page_tensors(layer)[0][p].flatten()[0].item() == int.from_bytes(h, "big") + layer
    return tier_expect


@pytest.mark.parametrize("way", ["torch", "kernel"])
@pytest.mark.parametrize("seed", range(8))
def test_copies_are_ordered_against_the_forward_and_land_the_right_bytes(seed, way, monkeypatch):
    """Both ways of moving pages (torch copies by runs of slots; the Triton kernel, here
    interpreted) under random schedules: no race, every byte where the plan said."""
    monkeypatch.setenv("PAGEDKV_PAGE_COPY", way)
    fs = FakeStreams()
    storage = KVCacheStorage(SPEC, PAGES)
    worker = DeviceOffloadWorker(storage.like(SLOTS), torch.device("cpu"), fs, _FakeDisk())
    expect = _run(worker, fs, storage, _scenario(seed))
    assert fs.races == []
    for (layer, slot), value in expect.items():
        assert worker.tier.page_tensors(layer)[0][slot].flatten()[0].item() == value


class _SaveBeforeWrite(DeviceOffloadWorker):
    def save_kv_layer(self, layer, storage, attn_metadata):  # forgets to wait for the layer's write
        if self.metadata and self.metadata.saves:
            self._to_tier(self.streams.save, storage, layer, self.metadata.saves)


class _NoLoadWait(DeviceOffloadWorker):
    def wait_for_layer_load(self, layer):  # the layer reads before its pages landed
        self._load_events.pop(layer, None)


class _NoStartWait(DeviceOffloadWorker):
    def start_load_kv(self, storage):  # swap-outs not ordered after the previous step's writes
        record = self.streams.record
        self.streams.record = lambda stream: record(self.streams.copy) if stream is self.streams.compute else record(
            stream)
        try:
            super().start_load_kv(storage)
        finally:
            self.streams.record = record


def test_the_step_waits_for_its_saves_when_the_last_layers_save_nothing():
    """A target model's layers save, a draft model's (the storage's last layers) do not run
    this step: the step still ends only after every save, so the next step may write the
    saved page at once."""
    fs = FakeStreams()
    storage = KVCacheStorage(SPEC, PAGES)
    worker = DeviceOffloadWorker(storage.like(SLOTS), torch.device("cpu"), fs)
    steps = [_Step(OffloadMeta(1, saves=[(5, 3)]), [5], [5], samples=False, save_layers=LAYERS - 1),
             _Step(OffloadMeta(2), [5], [5], samples=False)]
    _run(worker, fs, storage, steps)
    assert fs.races == []


class _HooksForSavesOnly(DeviceOffloadWorker):
    def needs_layer_hooks(self):  # forgets that disk loads need the layers to wait too
        meta = self.metadata
        return meta is not None and bool(meta.saves or meta.loads or meta.swap_ins)


@pytest.mark.parametrize("broken", [_SaveBeforeWrite, _NoLoadWait, _NoStartWait, _HooksForSavesOnly])
def test_the_fake_gpu_catches_a_missing_wait(broken):
    """The checker can fail: each wait, left out, shows up as a race in some scenario."""
    races = []
    for seed in range(8):
        fs = FakeStreams()
        storage = KVCacheStorage(SPEC, PAGES)
        worker = broken(storage.like(SLOTS), torch.device("cpu"), fs, _FakeDisk())
        try:
            _run(worker, fs, storage, _scenario(seed))
        except AssertionError:
            pass  # bytes may be wrong as well
        races += fs.races
    assert races


def test_the_forward_never_waits_for_a_save():
    """Layers of 1 s, saves of 0.5 s each: the compute stream ends when it would with no
    tier; each save starts after its layer and ends behind the next layer (or the LM head),
    so the step's end is the sampled tokens' time."""
    fs = FakeStreams(link_bytes_per_s=1.0)
    storage = KVCacheStorage(SPEC, PAGES)
    worker = DeviceOffloadWorker(storage.like(SLOTS), torch.device("cpu"), fs)
    per_page = worker.tier.page_size_bytes // LAYERS
    fs.link_bytes_per_s = 2 * per_page  # one page: 0.5 s
    meta = OffloadMeta(1, saves=[(5, 3)])
    _run(worker, fs, storage, [_Step(meta, [5], [5])])
    layers = [fs.ends("compute", f"layer {i}")[0] for i in range(LAYERS)]
    saves = fs.ends("save", "_to_tier")
    assert [e for _, e in layers] == [1.0, 2.0, 3.0] and fs.ends("compute", "head") == [(3.0, 4.0)]
    assert [s for s, _ in saves] == [e for _, e in layers]  # each at its layer's write
    assert all(e <= s + 0.5 + 1e-9 for (s, e) in saves)
    assert fs.host.time == 4.0 and fs.races == []


def test_loads_run_ahead_of_the_layers_that_read_them():
    """Loads go layer by layer on the copy stream: layer 0 starts when its own pages are in,
    not when every layer's are."""
    fs = FakeStreams(link_bytes_per_s=1.0)
    storage = KVCacheStorage(SPEC, PAGES)
    worker = DeviceOffloadWorker(storage.like(SLOTS), torch.device("cpu"), fs)
    fs.link_bytes_per_s = worker.tier.page_size_bytes // LAYERS / 0.25  # one page of a layer: 0.25 s
    meta = OffloadMeta(1, loads=[(0, 7), (1, 8)])
    for layer in range(LAYERS):
        _fill(worker.tier, layer, [0, 1], 10.0 * layer)
    _run(worker, fs, storage, [_Step(meta, [9], [7, 8])],
         tier_expect={(layer, s): 10.0 * layer + s for layer in range(LAYERS) for s in (0, 1)})
    loads = fs.ends("copy", "_to_device")
    layers = [fs.ends("compute", f"layer {i}")[0] for i in range(LAYERS)]
    assert [e for _, e in loads] == [0.5, 1.0, 1.5]
    assert [s for s, _ in layers] == [0.5, 1.5, 2.5]  # layer 0 after its loads only
    assert fs.races == []


# ---- end to end, float path -----------------------------------------------------------------

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
FILLERS = [list(range(3000 + 100 * i, 3000 + 100 * i + 60)) for i in range(4)]


def _gen(llm, ids):
    o = llm.generate([{"prompt_token_ids": ids}], PARAMS)[0]
    return o.token_ids, o.logprobs


@pytest.mark.parametrize("way", ["torch", "kernel"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_on_the_float_path_a_prefix_from_the_tier_gives_the_device_hits_output(tiny_llm_factory, kv_dtype, way,
                                                                                monkeypatch):
    """bf16 compute (the GPU's path, on CPU tensors): a prompt whose prefix comes back from
    the tier gives the tokens and log-probs of the same prompt served by a device prefix hit
    (the same blocks, the same bytes), and the tier's counters say it was loaded; pages moved
    by torch copies or by the page-copy kernel (interpreted)."""
    monkeypatch.setenv("PAGEDKV_PAGE_COPY", way)
    ref = tiny_llm_factory(num_blocks=96, dtype="bfloat16", kv_cache_dtype=kv_dtype)
    llm = tiny_llm_factory(num_blocks=12, dtype="bfloat16", kv_offload_memory="256KiB", kv_cache_dtype=kv_dtype)
    worker = llm.engine.runner.connector
    assert isinstance(worker, DeviceOffloadWorker) and worker._move.__name__ == f"{way.replace('torch', 'run')}_move"
    for n in (17, 33, 64):
        prompt = list(range(700 + n, 700 + 2 * n))
        for model in (ref, llm):
            assert _gen(model, prompt)  # first time: computed (and written through)
            for f in FILLERS:
                _gen(model, f)
        before = llm.engine.stats().kv_offload["hit_tokens"]
        assert _gen(llm, prompt) == _gen(ref, prompt), n
        assert llm.engine.stats().kv_offload["hit_tokens"] - before == 16 * ((n - 1) // 16)
    s = llm.engine.stats().kv_offload
    assert s["blocks_loaded"] > 0 and s["blocks_saved"] > 0 and s["copy_bytes_per_s"] > 0


def test_on_the_float_path_swap_preemption_keeps_the_tokens(tiny_llm_factory):
    """Requests preempted by swap (pages out to the tier, back on resume) give the tokens
    they give alone."""
    prompts = [list(range(400 + 50 * i, 440 + 50 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = tiny_llm_factory(num_blocks=64, dtype="bfloat16", enable_prefix_caching=True)
    want = [alone.generate([{"prompt_token_ids": p}], params)[0].token_ids for p in prompts]
    llm = tiny_llm_factory(num_blocks=12, dtype="bfloat16", kv_offload_memory="1MiB", preemption_mode="swap")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    s = llm.engine.stats()
    assert s.kv_offload["swap_outs"] > 0 and s.kv_offload["swap_blocks_in"] > 0
    assert [o.token_ids for o in outs] == want


@pytest.mark.filterwarnings("ignore:pagedkv. KV disk tier. unreadable record")
def test_on_the_float_path_disk_records_come_back_through_the_staging_pages(tiny_llm_factory, tmp_path):
    """bf16: a restarted engine serves the prompt's full blocks from disk (read into staging
    pages, copied like loads) with the output of a device prefix hit; damaged records are
    misses, and the output is the freshly computed one."""
    import gc

    prompt = list(range(900, 940))
    ref = tiny_llm_factory(num_blocks=64, dtype="bfloat16")
    fresh, hit = _gen(ref, prompt), _gen(ref, prompt)
    tiered = dict(num_blocks=12, dtype="bfloat16", kv_offload_memory=16 * 8192, kv_offload_dir=str(tmp_path))
    first = tiny_llm_factory(**tiered)
    assert _gen(first, prompt) == fresh
    first.close()
    del first
    gc.collect()
    second = tiny_llm_factory(**tiered)
    assert _gen(second, prompt) == hit
    s = second.engine.stats().kv_offload
    assert s["disk_blocks_loaded"] == 2 and s["disk_hit_tokens"] == 32 and s["load_seconds"] > 0
    second.close()
    del second
    gc.collect()
    for f in tmp_path.glob("*.kvb"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0x01
        f.write_bytes(bytes(data))
    third = tiny_llm_factory(**tiered)
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        assert _gen(third, prompt) == fresh
    assert third.engine.stats().kv_offload["disk_corrupt_records"] >= 1


def test_decode_steps_without_copies_replay_the_graph_with_a_tier(tiny_model_dir):
    """With a tier, a decode step whose plan has no load or save for the layers takes the
    CUDA graph path (here its buffers replayed eagerly, ``capture=False``); a step that saves
    a block runs eagerly with the layer hooks. Tokens as the plain engine's, blocks saved."""
    from pagedkv import LLM
    from pagedkv.config import EngineConfig
    from pagedkv.core.build import build_scheduler
    from pagedkv.core.engine_core import EngineCore
    from pagedkv.core.request import Request
    from pagedkv.engine.build import build_connector
    from pagedkv.engine.parts import build_parts
    from pagedkv.worker.cuda_graphs import DecodeGraphs
    from pagedkv.worker.model_runner import ModelRunner

    prompts = [list(range(100, 100 + n)) for n in (5, 17, 30)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_model_dir), num_blocks=64, max_num_seqs=8, dtype="bfloat16",
                          kv_offload_memory="1MiB")
    want = LLM(model=str(tiny_model_dir), num_blocks=64, dtype="bfloat16").generate(
        [{"prompt_token_ids": p} for p in prompts], params)
    parts = build_parts(config)
    connector = build_connector(config, parts, None)
    graphs = DecodeGraphs(parts.model, parts.kv_cache, 16, 8, parts.max_model_len, capture=False)
    runs, eager = [], []
    real_run, real_forward = graphs.run, parts.model.forward
    graphs.run = lambda *a: runs.append(len(a[0])) or real_run(*a)

    def forward(*a, **k):
        if not k.get("graph_safe"):  # the graph buffers' replay calls forward too: not counted
            eager.append(a[4] is not None)
        return real_forward(*a, **k)
    parts.model.forward = forward
    runner = ModelRunner(parts.model, parts.kv_cache, parts.kv_manager.kv_groups, torch.Generator(),
                         connector.worker, graphs=graphs)
    core = EngineCore(build_scheduler(config, parts.kv_manager, parts.max_model_len, connector=connector.scheduler),
                      runner)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params, max_tokens=24))
    got = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.request_id].extend(o.new_token_ids)
    assert [got[f"r{i}"] for i in range(len(prompts))] == [w.token_ids for w in want]
    saved = connector.scheduler.get_stats()["blocks_saved"]
    assert len(runs) >= 10 and all(eager) and saved >= 5  # decodes replayed; other steps eager, with hooks
    assert len(eager) >= 4  # the prefill, and decode steps that filled a block (r2 at 32 and 48, r0 at 16, ...)


def test_a_kernel_that_cannot_address_the_tier_gives_way_to_torch_copies(monkeypatch):
    """Where Triton refuses the pinned tier's pointer (it cannot be accessed from the GPU),
    the worker warns once and moves pages by torch copies from then on; the bytes land."""
    import pagedkv.kernels.triton.page_copy as page_copy

    def refuse(*a):
        raise ValueError("Pointer argument (at 1) cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setenv("PAGEDKV_PAGE_COPY", "kernel")
    monkeypatch.setattr(page_copy, "copy_pages", refuse)
    fs = FakeStreams()
    storage = KVCacheStorage(SPEC, PAGES)
    worker = DeviceOffloadWorker(storage.like(SLOTS), torch.device("cpu"), fs, _FakeDisk())
    with pytest.warns(RuntimeWarning, match="page-copy kernel failed .*cannot be accessed"):
        expect = _run(worker, fs, storage, _scenario(0))
    assert worker._move.__name__ == "run_move"
    for (layer, slot), value in expect.items():
        assert worker.tier.page_tensors(layer)[0][slot].flatten()[0].item() == value
    monkeypatch.setenv("PAGEDKV_PAGE_COPY", "fast")
    with pytest.raises(ValueError, match="PAGEDKV_PAGE_COPY must be one of"):
        DeviceOffloadWorker(storage.like(SLOTS), torch.device("cpu"), fs)


def test_a_pinned_tier_locks_exactly_its_bytes_and_lets_them_go(monkeypatch):
    """Beside a GPU the tier is host memory locked in place (cudaHostRegister), not torch's
    pinned allocator (which rounds each block up to a power of two): every page tensor is
    registered at its own size, unregistered when the tier goes; a refusal is a clear error."""
    import gc

    import pagedkv.kv_cache.pinned as pinned

    calls = []

    class FakeCudart:
        def __init__(self, err=0):
            self.err = err

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return self.err

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr, None))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "_cudart", lambda: FakeCudart())
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, dtype="int8", block_size=4)
    tier = KVCacheStorage(spec, 37, pin_memory=True)  # int8 pages with per-token bf16 scales
    tensors = [t for layer in range(2) for t in tier.page_tensors(layer)]
    registered = {ptr: size for kind, ptr, size in calls if kind == "register"}
    assert sorted(registered.items()) == sorted((t.data_ptr(), t.numel() * t.element_size()) for t in tensors)
    assert all(tier.layer(i).k_scale.abs().min() == 1 for i in range(2))  # the scales' ones survive
    del tier, tensors
    gc.collect()
    assert {ptr for kind, ptr, _ in calls if kind == "unregister"} == set(registered)
    monkeypatch.setattr(pinned, "_cudart", lambda: FakeCudart(err=2))
    with pytest.raises(RuntimeError, match="cannot lock .* GiB of host memory for the KV tier"):
        KVCacheStorage(SPEC, 8, pin_memory=True)
