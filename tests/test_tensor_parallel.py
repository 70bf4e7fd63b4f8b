"""Tensor parallelism (issue 16): the partition arithmetic, TP=2 against TP=1 over gloo on
loopback (tokens equal, log-probs within the all-reduce's rounding), per-rank KV bytes
against the planner, and the failure paths (a dead or hung worker fails the engine loudly
within a bound; nothing hangs)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from conftest import make_hf_folder

from pagedkv import LLM, SamplingParams
from pagedkv.config.engine import EngineConfig
from pagedkv.distributed.executor import TPGroupError
from pagedkv.engine.parts import build_parts
from pagedkv.model.config import head_spans
from pagedkv.model.ggml_weights import Q4_1, GGMLWeight
from pagedkv.model.partition import Partition, shard_state
from pagedkv.planner.plan import plan

LOGPROB_TOL = 1e-4  # the all-reduce sums partial products in another order than one rank's GEMM
PROMPTS = ["Hello there, how are", "The capital of France is",
           {"prompt_token_ids": list(range(100, 141))}]  # 41 tokens: two full 16-token pages and a partial one


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory, default_model_files):
    """6 query heads over 3 KV heads: TP=2 holds 2 and 1 KV heads."""
    return make_hf_folder(tmp_path_factory.mktemp("tp-uneven"), tokenizer_from=default_model_files.folder,
                          hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192)


def _greedy(llm, prompts=PROMPTS, n=12):
    return llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, logprobs=1, ignore_eos=True))


def assert_same_greedy(a, b) -> None:
    for x, y in zip(a, b):
        assert x.error is None and y.error is None
        assert x.token_ids == y.token_ids
        lx = torch.tensor([lp[t] for lp, t in zip(x.logprobs, x.token_ids)])
        ly = torch.tensor([lp[t] for lp, t in zip(y.logprobs, y.token_ids)])
        assert torch.allclose(lx, ly, atol=LOGPROB_TOL, rtol=0)


# ---- the arithmetic, in process ----------------------------------------------------------
def test_head_spans_split_whole_kv_groups():
    assert head_spans(9, 3, 2) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]  # SmolLM2-135M: uneven
    assert head_spans(32, 8, 4) == [((8 * r, 8 * r + 8), (2 * r, 2 * r + 2)) for r in range(4)]
    assert head_spans(8, 2, 4) == [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]
    with pytest.raises(ValueError, match="does not split 3 KV heads"):
        head_spans(9, 3, 4)
    with pytest.raises(ValueError, match="does not split 2 KV heads"):
        head_spans(8, 2, 3)


def test_shards_put_back_together_are_the_weights(uneven_dir):
    from pagedkv.model.loader import load_state_dict, resolve_model
    cfg = resolve_model(str(uneven_dir)).config
    state = load_state_dict(uneven_dir)
    parts = [Partition(r, 2, q, kv, mlp) for r, ((q, kv), mlp) in
             enumerate(zip(head_spans(6, 3, 2), [(0, 96), (96, 192)]))]
    shards = [shard_state(state, cfg, p) for p in parts]
    p = "model.layers.1."
    for name, dim in (("self_attn.q_proj", 0), ("self_attn.k_proj", 0), ("self_attn.o_proj", 1),
                      ("mlp.gate_proj", 0), ("mlp.down_proj", 1)):
        key = p + name + ".weight"
        assert torch.equal(torch.cat([s[key] for s in shards], dim), state[key])
    assert shards[0][p + "self_attn.k_proj.weight"].shape[0] == 2 * cfg.head_dim  # 2 of 3 KV heads
    assert shards[1]["model.embed_tokens.weight"] is state["model.embed_tokens.weight"]  # replicated


def test_ggml_blocks_split_by_whole_blocks_only():
    from pagedkv.model.partition import _columns, _rows
    w = GGMLWeight.quantize(torch.randn(8, 128), Q4_1)
    whole = w.dequantize()
    assert torch.equal(_columns(w, (32, 96), "w").dequantize(), whole[:, 32:96])
    assert torch.equal(_rows(w, (2, 6)).dequantize(), whole[2:6])
    with pytest.raises(ValueError, match="cuts one"):
        _columns(w, (0, 48), "w")


def test_each_rank_allocates_the_planners_per_device_bytes(uneven_dir):
    """Ranks 0 and 1 of TP=2 built in process (the all-reduce a no-op: nothing runs): rank 0
    holds 2 of 3 KV heads, which is what the planner prints per device; rank 1 holds 1."""
    config = EngineConfig(model=str(uneven_dir), num_blocks=8, tensor_parallel_size=2)
    per_token = []
    for rank in range(2):
        parts = build_parts(config, SimpleNamespace(rank=rank, world=2, all_reduce=lambda t: None))
        per_token.append(parts.kv_cache.nbytes // (parts.kv_manager.pool.num_pages * 16))
        assert parts.kv_manager.pool.num_blocks == 8  # same page ids on every rank
    p = plan(str(uneven_dir), tp=2, kv_cache_dtype="float32")
    assert per_token[0] == p.bytes_per_token_per_device == 2 * 2 * 2 * 16 * 4  # layers, K+V, heads, dim, fp32
    assert per_token[1] == per_token[0] // 2


def test_config_refuses_what_tp_does_not_cover(uneven_dir, tiny_model_dir):
    for bad in ({"tensor_parallel_size": 0}, {"tensor_parallel_size": 2, "distributed_timeout": 0},
                {"tensor_parallel_size": 2, "kv_eviction": "snapkv", "kv_budget_tokens": 64},
                {"tensor_parallel_size": 2, "kv_offload_memory": "1MiB"},
                {"tensor_parallel_size": 2, "kv_cache_dtype": "int8", "kv_cache_scale": "per-tensor"}):
        with pytest.raises(ValueError, match="tensor_parallel_size|distributed_timeout"):
            EngineConfig(model=str(uneven_dir), **bad)
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="does not split 2 KV heads"):  # tiny: 4 query heads, 2 KV heads
        LLM(model=str(tiny_model_dir), num_blocks=16, tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) == before  # refused before any process started


# ---- two processes -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp1_outputs(uneven_dir):
    with LLM(model=str(uneven_dir), num_blocks=64, max_num_batched_tokens=16) as llm:
        return _greedy(llm)


def test_tp2_greedy_equals_tp1_with_chunked_prefill_and_prefix_hits(uneven_dir, tp1_outputs):
    with LLM(model=str(uneven_dir), num_blocks=64, max_num_batched_tokens=16, tensor_parallel_size=2,
             debug_invariants=True) as llm:
        assert_same_greedy(tp1_outputs, _greedy(llm))
        again = _greedy(llm, PROMPTS[2:])  # the group serves call after call; its full pages are a prefix hit
        assert again[0].num_cached_tokens == 32
        assert_same_greedy(tp1_outputs[2:], again)


def test_tp2_with_replicated_kv_heads_and_static_int8_scales(tmp_path, default_model_files):
    """One KV head on two ranks (replicated, each rank half the query heads), int8 pages with
    static per-head scales: the calibration's forward runs the all-reduce on every rank."""
    d = make_hf_folder(tmp_path / "mqa", tokenizer_from=default_model_files.folder, num_key_value_heads=1)
    kw = dict(model=str(d), num_blocks=64, kv_cache_dtype="int8", kv_cache_scale="per-head")
    with LLM(**kw) as one:
        ref = _greedy(one, PROMPTS[:2])
    with LLM(**kw, tensor_parallel_size=2) as two:
        assert_same_greedy(ref, _greedy(two, PROMPTS[:2]))


def _worker(llm):
    (proc,) = llm.engine.runner.procs
    return proc


def test_a_killed_worker_fails_the_engine_at_once(uneven_dir):
    llm = LLM(model=str(uneven_dir), num_blocks=64, tensor_parallel_size=2)
    try:
        proc = _worker(llm)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(TPGroupError, match="rank 1"):
            llm.engine.check_health()
        t0 = time.monotonic()
        with pytest.raises(TPGroupError, match="rank 1"):
            _greedy(llm, PROMPTS[:1])
        assert time.monotonic() - t0 < 5
        with pytest.raises(TPGroupError):  # and every later step, at once
            _greedy(llm, PROMPTS[:1])
    finally:
        llm.close()


def test_a_hung_worker_fails_the_step_within_the_timeout(uneven_dir):
    llm = LLM(model=str(uneven_dir), num_blocks=64, tensor_parallel_size=2, distributed_timeout=3)
    proc = _worker(llm)
    try:
        _greedy(llm, PROMPTS[:1], n=2)
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TPGroupError, match="rank 0"):
            _greedy(llm, PROMPTS[:1])
        assert 2 < time.monotonic() - t0 < 15
        proc.join(10)
        assert not proc.is_alive()  # the stopped worker was killed, not left behind
    finally:
        llm.close()


def test_server_health_goes_503_when_a_worker_dies(uneven_dir):
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.server.app import ServerConfig, build_app
    from pagedkv.server.live import LiveServer

    engine = LLMEngine(model=str(uneven_dir), num_blocks=64, tensor_parallel_size=2)
    srv = LiveServer(build_app(engine, ServerConfig(["tiny"]))).start()
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        os.kill(engine.runner.procs[0].pid, signal.SIGKILL)
        engine.runner.procs[0].join(10)
        assert httpx.get(srv.url + "/health").status_code == 503
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code >= 500 and time.monotonic() - t0 < 10
    finally:
        srv.stop()


def test_tp2_on_the_real_model_equals_tp1(smollm):
    """SmolLM2-135M (its GGUF's Q4_1 blocks, 9 query and 3 KV heads: ranks hold 2 and 1 KV
    heads) split over two processes gives the one-process greedy tokens."""
    prompts = ["Write a haiku about the sea.", "Explain paged attention in one sentence."]
    ref = _greedy(smollm, prompts, n=16)
    with LLM(num_blocks=64, tensor_parallel_size=2) as llm:
        assert_same_greedy(ref, _greedy(llm, prompts, n=16))


def test_the_timeout_flag_and_one_engine_per_process(uneven_dir):
    from pagedkv.cli_common import OneLineErrorParser, add_engine_args
    p = OneLineErrorParser()
    add_engine_args(p)
    assert p.parse_args(["--distributed-timeout", "2.5"]).distributed_timeout == 2.5
    with LLM(model=str(uneven_dir), num_blocks=16, tensor_parallel_size=2, distributed_timeout=20.0):
        with pytest.raises(ValueError, match="one tensor-parallel engine per process"):
            LLM(model=str(uneven_dir), num_blocks=16, tensor_parallel_size=2)


def test_a_worker_that_dies_while_starting_is_reported_at_once(uneven_dir, monkeypatch):
    """The worker runs a function that exits before it joins (as a script without a main
    guard does under spawn): rank 0 says so at once instead of waiting out the rendezvous."""
    import pagedkv.distributed.executor as ex
    monkeypatch.setattr(ex, "worker_main", _exit_at_once)
    t0 = time.monotonic()
    with pytest.raises(TPGroupError, match="rank 1 exited while starting"):
        LLM(model=str(uneven_dir), num_blocks=16, tensor_parallel_size=2, distributed_timeout=30)
    assert time.monotonic() - t0 < 15


def _exit_at_once(*args) -> None:
    os._exit(3)


def test_a_failed_group_is_one_error_line_from_the_cli(monkeypatch, capsys):
    """A dead rank ends `pagedkv generate` with its reason on one line (exit 1), gloo's
    source path and advice left out, not a traceback."""
    from pagedkv import cli
    from pagedkv.distributed.executor import TPGroupError, _first_line

    gloo = RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. "
                        "This is typically caused by a remote worker hanging. GLHF!")
    assert _first_line(gloo) == "Read error [127.0.0.1]:1: Connection reset by peer."

    def dead(_args):
        raise TPGroupError(f"the tensor-parallel group failed: rank 1: the process exited (code -9); "
                           f"rank 0: RuntimeError: {_first_line(gloo)}")

    monkeypatch.setattr(cli, "_run_generate", dead)
    assert cli.main(["generate", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the tensor-parallel group failed: rank 1")
