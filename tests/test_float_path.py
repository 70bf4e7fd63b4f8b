"""The GPU's code path, run on the CPU (issue 52): float weights in the compute dtype, the
Triton attention kernel (interpreted, ``PAGEDKV_ATTENTION=triton``), torch ops for the rest,
step tensors and samplers on the model's device. A GPU engine runs this path with
``device="cuda"``; CI has no GPU, so the same code runs here on CPU tensors, against the CPU
engine. Plus the device and dtype settings, what they refuse, and the KV budget arithmetic
of ``--gpu-memory-utilization``."""

from __future__ import annotations

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.config import EngineConfig
from pagedkv.worker.device import check_features, compute_dtype, float_path, resolve_device
from pagedkv.worker.memory import MemoryProfile, kv_budget_bytes

pytest.importorskip("triton")
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
PROMPTS = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 17, 33)]


@pytest.fixture(scope="module")
def cpu_reference(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), num_blocks=64).generate(PROMPTS, PARAMS)


def _max_logprob_gap(outs, ref) -> float:
    return max(abs(a[t] - b[t]) for o, r in zip(outs, ref) for a, b, t in zip(o.logprobs, r.logprobs, r.token_ids))


def test_the_triton_kernel_in_the_engine_gives_the_cpu_engines_tokens(tiny_model_dir, cpu_reference, monkeypatch):
    """fp32, the Triton kernel for attention (what ``--device cuda --dtype float32`` runs):
    the same greedy tokens, log-probs within float rounding, through prefill chunks and a
    prefix hit."""
    monkeypatch.setenv("PAGEDKV_ATTENTION", "triton")
    llm = LLM(model=str(tiny_model_dir), num_blocks=64, max_num_batched_tokens=16)
    for _ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == [r.token_ids for r in cpu_reference]
        assert _max_logprob_gap(outs, cpu_reference) < 1e-4
    assert llm.engine.kv_manager.prefix_hits > 0


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_bfloat16_compute_runs_on_float_weights_and_keeps_the_tokens(tiny_model_dir, cpu_reference, monkeypatch,
                                                                     attention):
    monkeypatch.setenv("PAGEDKV_ATTENTION", attention)
    llm = LLM(model=str(tiny_model_dir), num_blocks=64, dtype="bfloat16")
    model = llm.engine.model
    assert model.dtype == torch.bfloat16 and model.layers[0].qkv.dtype == torch.bfloat16
    assert llm.engine.kv_cache.layer(0).k.dtype == torch.bfloat16  # kv_cache_dtype auto: the compute dtype
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in outs] == [r.token_ids for r in cpu_reference]
    assert 0 < _max_logprob_gap(outs, cpu_reference) < 0.1  # bf16 rounding, not another computation


def test_a_gguf_is_dequantized_for_the_float_path(default_model_files):
    """The default model's GGUF blocks become bf16 tensors (the C++ block kernels are CPU
    float32 ops); a one-token answer comes out."""
    llm = LLM(num_blocks=32, dtype="bfloat16", max_model_len=64)
    layer = llm.engine.model.layers[0]
    assert isinstance(layer.qkv, torch.Tensor) and layer.qkv.dtype == torch.bfloat16
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert "Paris" in out.text


def test_device_and_dtype_settings():
    assert resolve_device(EngineConfig()).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert compute_dtype(EngineConfig(), torch.device("cpu")) == torch.float32
    assert compute_dtype(EngineConfig(), torch.device("cuda")) == torch.bfloat16
    assert not float_path(torch.device("cpu"), torch.float32) and float_path(torch.device("cuda"), torch.float32)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            resolve_device(EngineConfig(device="cuda"))
    for bad, match in (({"device": "tpu"}, "device must be"), ({"dtype": "int8"}, "dtype must be"),
                       ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
                       ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)


@pytest.mark.parametrize("kw,match", [({"weight_dtype": "int8"}, "weight_dtype int8"),
                                      ({"activation_dtype": "int8"}, "activation_dtype int8"),
                                      ({"tensor_parallel_size": 2}, "tensor_parallel_size")])
def test_what_the_float_path_does_not_run_yet_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        check_features(EngineConfig(**kw), torch.device("cpu"), torch.bfloat16)
    check_features(EngineConfig(**kw), torch.device("cpu"), torch.float32)  # the CPU path runs them


def test_a_draft_model_speculates_on_the_float_path(tiny_model_dir, cpu_reference, monkeypatch):
    """Draft-model speculation with the draft on the engine's device and dtype, verified
    there: the target's greedy tokens (fp32 with the Triton kernel: the CPU engine's), the
    same model as its own draft accepting drafts."""
    monkeypatch.setenv("PAGEDKV_ATTENTION", "triton")
    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}
    for dtype in ("float32", "bfloat16"):
        plain = LLM(model=str(tiny_model_dir), num_blocks=64, dtype=dtype).generate(PROMPTS, PARAMS)
        llm = LLM(model=str(tiny_model_dir), num_blocks=64, dtype=dtype, speculative_config=spec)
        assert llm.engine.parts.draft.model.dtype == getattr(torch, dtype)
        outs = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        if dtype == "float32":
            assert [o.token_ids for o in outs] == [r.token_ids for r in cpu_reference]
        assert llm.stats().spec_decode["num_accepted_tokens"] > 0


def test_snapkv_scores_on_the_float_path_keep_the_cpu_engines_tokens(tiny_model_dir, monkeypatch):
    """SnapKV's scores from the float path's queries and pages (fp32, Triton attention) pick
    the CPU engine's tokens to keep, and generation after compaction matches."""
    snap = dict(kv_eviction="snapkv", kv_budget_tokens=24, num_sink_tokens=2, kv_window_tokens=8, block_size=16,
                num_blocks=32, max_num_batched_tokens=32)
    prompt = [{"prompt_token_ids": list(range(300, 370))}]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def run(**kw):
        llm = LLM(model=str(tiny_model_dir), **snap, **kw)
        kept, choose = [], llm.engine.runner._choose
        llm.engine.runner._choose = lambda scorer, out: kept.append(choose(scorer, out)) or kept[-1]
        return llm.generate(prompt, params)[0].token_ids, kept, llm.stats().blocks_freed_by_eviction

    cpu = run()
    monkeypatch.setenv("PAGEDKV_ATTENTION", "triton")
    floated = run()
    assert floated == cpu and cpu[1] and cpu[2] > 0
    tokens, kept, freed = run(dtype="bfloat16")  # the float path proper: scores from bf16 queries and pages
    assert freed == cpu[2] and len(kept) == len(cpu[1]) and tokens[:3] == cpu[0][:3]


def test_streaming_eviction_on_the_triton_kernel_gives_the_cpu_engines_tokens(tiny_model_dir, monkeypatch):
    """StreamingLLM (window + sinks, queries at cache positions: q a view into the fused
    QKV, sink_q its own tensor) through the Triton kernel: the CPU engine's tokens."""
    kw = dict(kv_eviction="streaming", kv_window_tokens=32, num_sink_tokens=4, num_blocks=64, max_model_len=1024)
    prompt = [{"prompt_token_ids": list(range(100, 220))}]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    cpu = LLM(model=str(tiny_model_dir), **kw).generate(prompt, params)[0].token_ids
    monkeypatch.setenv("PAGEDKV_ATTENTION", "triton")
    assert LLM(model=str(tiny_model_dir), **kw).generate(prompt, params)[0].token_ids == cpu


def test_the_kv_budget_is_what_the_utilization_leaves():
    gib = 2**30
    assert kv_budget_bytes(80 * gib, 0.9, 16 * gib, 2 * gib, gib) == int(72 * gib) - 19 * gib
    p = MemoryProfile(80 * gib, 16 * gib, 2 * gib, gib)
    assert p.kv_budget(0.5) == 21 * gib and "KV 21.00 GiB" in p.describe(0.5)
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        kv_budget_bytes(16 * gib, 0.9, 14 * gib, gib, gib)


# ---- CUDA graphs' bookkeeping, run eagerly on the CPU ---------------------------------------
def test_graph_buckets_and_splits():
    from pagedkv.worker.cuda_graphs import bucket_for, graph_buckets, splits_for

    assert graph_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert graph_buckets(12) == [1, 2, 4, 8, 12] and graph_buckets(1) == [1]
    assert graph_buckets(1000)[-1] == 256
    b = graph_buckets(64)
    assert [bucket_for(n, b) for n in (1, 3, 8, 9, 17, 64, 65)] == [1, 4, 8, 16, 24, 64, None]
    assert splits_for(1, 512) == 16 and splits_for(64, 512) == 1 and splits_for(8, 16) == 1
    assert all(s & (s - 1) == 0 for s in (splits_for(n, p) for n in (1, 3, 8, 24) for p in (32, 100, 4096)))


def test_decode_steps_through_the_graph_buffers_give_the_eager_tokens(tiny_model_dir, monkeypatch):
    """The padded persistent buffers, the device-side sequence layout and the null page's
    clean-up, replayed eagerly (``capture=False``) inside a real engine core: a batch of 3
    decodes runs as bucket 4, and every token and log-prob is the eager engine's."""
    from pagedkv.config import EngineConfig
    from pagedkv.core.build import build_scheduler
    from pagedkv.core.engine_core import EngineCore
    from pagedkv.core.request import Request
    from pagedkv.engine.parts import build_parts
    from pagedkv.worker.cuda_graphs import DecodeGraphs
    from pagedkv.worker.model_runner import ModelRunner

    monkeypatch.setenv("PAGEDKV_ATTENTION", "triton")
    config = EngineConfig(model=str(tiny_model_dir), num_blocks=64, max_num_seqs=8)
    want = LLM(model=str(tiny_model_dir), num_blocks=64).generate(PROMPTS, PARAMS)
    parts = build_parts(config)
    graphs = DecodeGraphs(parts.model, parts.kv_cache, 16, 8, parts.max_model_len, capture=False)
    runs = []
    monkeypatch.setattr(graphs, "run", lambda *a, real=graphs.run: runs.append(len(a[0])) or real(*a))
    runner = ModelRunner(parts.model, parts.kv_cache, parts.kv_manager.kv_groups, torch.Generator(), graphs=graphs)
    core = EngineCore(build_scheduler(config, parts.kv_manager, parts.max_model_len), runner)
    for i, p in enumerate(PROMPTS):
        core.add_request(Request(f"r{i}", p["prompt_token_ids"], PARAMS, max_tokens=8))
    got = {f"r{i}": ([], []) for i in range(len(PROMPTS))}
    while core.has_unfinished_requests():
        for o in core.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend(o.new_logprobs)
    assert runs and set(runs) == {3}  # the decodes (prefills ran eagerly)
    for i, w in enumerate(want):
        assert got[f"r{i}"][0] == w.token_ids
        assert max(abs(a[t] - b[t]) for a, b, t in zip(got[f"r{i}"][1], w.logprobs, w.token_ids)) < 1e-4
    assert parts.kv_cache.layer(0).k[0].abs().max() == 0  # the null page the padding wrote to is clean
