"""The device check's ``tiers`` section (issue 54): the CPU tier, swap and their copies with
the KV cache in GPU memory (pinned host tier, copies on their own CUDA streams).

- ``outputs``: fp32, a small device pool with a CPU tier: a prompt whose prefix the device
  lost comes back from the tier with the tokens and log-probs of a device prefix hit on a
  large pool, and, in batch-invariant mode, of the prompt computed whole (prefix caching
  off); swap preemption under a pool too small for the batch, against the same batch on the
  large pool;
- ``load_rate``: the tier's batched block loads (:func:`probe_device_copy_rate` at 256
  pages; the page-copy kernel, torch copies by runs, and the default way) against a pinned
  host-to-device copy of the same bytes in one piece; the planner's per-block load time
  (its PCIe figure) against the measured one;
- ``decode_saves``: mean decode step time of 32 requests over 64 steps (blocks filling,
  saves running) with the tier against without, CUDA graphs on in both;
- ``returning_turn``: 8 conversations of 2,048 tokens, a device pool that holds about two:
  the second turn's TTFT with the tier against recompute (prefix caching on in both);
- ``swap_vs_recompute``: 32 requests that outgrow the pool, under ``recompute``, ``swap`` and
  ``auto``: throughput of each and ``auto``'s priced choices.

``--quick`` (CPU, bf16 on the float path, tiny shapes) checks the script only.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from gpu_check_engine import SMOLLM2, TINY, build_model, free, llm, prompts
from gpu_check_speed import LLAMA8B, catalog_gpu

from pagedkv import SamplingParams
from pagedkv.connectors.offload.device_tier_worker import probe_device_copy_rate
from pagedkv.connectors.offload.page_moves import kernel_move, run_move


def pinned_h2d_bytes_per_s(device: str, nbytes: int) -> float:
    """Best of five copies of ``nbytes`` from pinned host memory to the device in one piece."""
    on_gpu = device == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(6):
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if on_gpu:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def _gen(engine, ids: list[int], params) -> tuple[list[int], list]:
    o = engine.generate([{"prompt_token_ids": ids}], params)[0]
    return o.token_ids, o.logprobs


def check_outputs(folder: Path, device: str, dtype: str, quick: bool) -> dict:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    vocab = TINY["vocab_size"] if quick else SMOLLM2["vocab_size"]
    lengths = [17, 33, 64] if quick else [17, 300, 1000]
    batch = prompts(len(lengths), lengths, vocab, 11)
    fillers = prompts(4, [60 if quick else 1200], vocab, 12)
    big = llm(folder, device, dtype=dtype, num_blocks=256, kv_cache_memory=None, enforce_eager=True)
    small = llm(folder, device, dtype=dtype, num_blocks=12 if quick else 110, kv_cache_memory=None,
                enforce_eager=True, kv_offload_memory="64MiB")
    same = hits = 0
    for p in batch:
        for engine in (big, small):
            _gen(engine, p["prompt_token_ids"], params)
            for f in fillers:
                _gen(engine, f["prompt_token_ids"], params)
        before = small.engine.stats().kv_offload["hit_tokens"]
        same += _gen(small, p["prompt_token_ids"], params) == _gen(big, p["prompt_token_ids"], params)
        hits += small.engine.stats().kv_offload["hit_tokens"] - before
    res = {"tier_vs_device_hit_identical": f"{same} of {len(batch)}", "tier_hit_tokens": hits}
    del small
    free()
    res["batch_invariant_tier_vs_recompute_identical"] = tier_vs_recompute(folder, device, dtype, quick, batch,
                                                                           fillers, params)
    swap_params = SamplingParams(max_tokens=24 if quick else 64, temperature=0.0, ignore_eos=True)
    many = prompts(8, [40 if quick else 400], vocab, 13)
    want = [o.token_ids for o in big.generate(many, swap_params)]
    swap = llm(folder, device, dtype=dtype, num_blocks=12 if quick else 80, kv_cache_memory=None, enforce_eager=True,
               kv_offload_memory="64MiB", preemption_mode="swap")
    got = [o.token_ids for o in swap.generate(many, swap_params)]
    stats = swap.engine.stats().kv_offload
    res["swap"] = {"identical_sequences": sum(a == b for a, b in zip(got, want)), "of": len(want),
                   "swap_outs": stats["swap_outs"], "blocks_in": stats["swap_blocks_in"]}
    del big, swap
    free()
    return res


def tier_vs_recompute(folder: Path, device: str, dtype: str, quick: bool, batch, fillers, params) -> str:
    """Batch-invariant mode: a prompt whose prefix came back from the tier against the same
    prompt computed whole with prefix caching off (the issue's fp32 invariant)."""
    kw = dict(dtype=dtype, kv_cache_memory=None, enforce_eager=True, batch_invariant=True)
    ref = llm(folder, device, num_blocks=256, enable_prefix_caching=False, **kw)
    tier = llm(folder, device, num_blocks=12 if quick else 110, kv_offload_memory="64MiB", **kw)
    same = 0
    for p in batch:
        _gen(tier, p["prompt_token_ids"], params)
        for f in fillers:
            _gen(tier, f["prompt_token_ids"], params)
        same += _gen(tier, p["prompt_token_ids"], params) == _gen(ref, p["prompt_token_ids"], params)
    del ref, tier
    free()
    return f"{same} of {len(batch)}"


def load_rate(folder: Path, device: str, dtype: str, gpu_name: str, quick: bool) -> dict:
    from pagedkv import plan

    engine = llm(folder, device, dtype=dtype, num_blocks=300 if not quick else 40, kv_cache_memory=None,
                 kv_offload_memory="1GiB" if not quick else "16MiB")
    worker, storage = engine.engine.core.runner.connector, engine.engine.kv_cache
    default = worker._move
    res = {}
    for way, move in (("torch_runs", run_move), ("kernel", kernel_move), ("default", default)):
        worker._move = move
        nbytes, seconds = probe_device_copy_rate(worker, storage, max_pages=256 if not quick else 16)
        res[f"{way}_bytes_per_s"] = nbytes / seconds
    ceiling = pinned_h2d_bytes_per_s(device, nbytes)
    rate, pages = res["default_bytes_per_s"], nbytes // worker.tier.page_size_bytes
    res.update({"default_way": default.__name__, "pages": pages, "page_bytes": worker.tier.page_size_bytes,
                "block_load_bytes_per_s": rate, "pinned_h2d_bytes_per_s": ceiling, "of_pinned_h2d": rate / ceiling,
                "measured_block_load_s": nbytes / rate / pages})
    if catalog_gpu(gpu_name):
        p = plan(model=str(folder), gpu=catalog_gpu(gpu_name), kv_cache_dtype=engine.engine.parts.kv_spec.dtype,
                 weight_dtype=dtype, kv_offload_memory="1GiB")
        planned = getattr(p, "offload_cpu_block_load_seconds", None)
        if planned:
            res["planner_block_load_s"] = planned
            res["planner_vs_measured"] = planned / res["measured_block_load_s"]
    del engine, worker, storage
    free()
    return res


def decode_saves(folder: Path, device: str, dtype: str, quick: bool) -> dict:
    from gpu_check_speed import _sync

    vocab = TINY["vocab_size"] if quick else LLAMA8B["vocab_size"]
    n, steps = (4, 8) if quick else (32, 64)
    res = {}
    for name, kw in (("tier_off", {}), ("tier_on", {"kv_offload_memory": "4GiB" if not quick else "16MiB"})):
        engine = llm(folder, device, dtype=dtype, gpu_memory_utilization=0.8, max_num_seqs=64, **kw).engine
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        started: set[str] = set()
        for i, p in enumerate(prompts(n, [100 + 7 * i for i in range(n)], vocab, 21)):  # blocks fill on
            engine.add_request(p, params, f"r{i}")                                     # different steps
        while len(started) < n:
            started.update(o.request_id for o in engine.step() if o.token_ids)
        _sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        res[name] = (time.perf_counter() - t) / steps
        if kw:
            res["blocks_saved"] = engine.stats().kv_offload["blocks_saved"]
        while engine.has_unfinished_requests():
            engine.step()
        del engine
        free()
    res["on_vs_off"] = res["tier_on"] / res["tier_off"]
    return res


def returning_turn(folder: Path, device: str, dtype: str, quick: bool) -> dict:
    vocab = TINY["vocab_size"] if quick else LLAMA8B["vocab_size"]
    ctx, convs = (64, 4) if quick else (2048, 8)
    first = prompts(convs, [ctx], vocab, 31)
    more = prompts(convs, [32], vocab, 32)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    blocks = 2 * (ctx // 16) + 32  # about two conversations
    res = {}
    for name, kw in (("recompute", {}), ("tier", {"kv_offload_memory": "8GiB" if not quick else "32MiB"})):
        engine = llm(folder, device, dtype=dtype, num_blocks=blocks, kv_cache_memory=None,
                     max_num_batched_tokens=ctx + 64, **kw)
        engine.generate(first, one)
        ttfts = [engine.generate([{"prompt_token_ids": a["prompt_token_ids"] + b["prompt_token_ids"]}], one)[0].ttft
                 for a, b in zip(first, more)]
        res[name] = sorted(ttfts)[len(ttfts) // 2]
        del engine
        free()
    res["recompute_vs_tier"] = res["recompute"] / res["tier"]
    return res


def swap_vs_recompute(folder: Path, device: str, dtype: str, quick: bool) -> dict:
    """A capacity-bound load (more KV than the pool holds) under each preemption mode:
    output tokens/s, preemptions by how they were done, and ``auto``'s priced choices
    (the predicted seconds of a swap's round trip and of a recompute, by kept tokens)."""
    vocab = TINY["vocab_size"] if quick else LLAMA8B["vocab_size"]
    n, ctx, n_out, blocks = (8, 40, 24, 14) if quick else (32, 1024, 256, 1200)
    batch = prompts(n, [ctx // 2, ctx], vocab, 41)
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    res = {}
    for mode in ("recompute", "swap", "auto"):
        engine = llm(folder, device, dtype=dtype, num_blocks=blocks, kv_cache_memory=None, max_num_seqs=n,
                     kv_offload_memory="8GiB" if not quick else "16MiB", preemption_mode=mode)
        engine.generate(batch[:2], SamplingParams(max_tokens=4))  # warm-up (and a first measured rate)
        t = time.perf_counter()
        outs = engine.generate(batch, params)
        seconds = time.perf_counter() - t
        core = engine.engine.core
        res[mode] = {"output_tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds,
                     "preemptions": dict(core.scheduler.preemptions_by_mode)}
        if mode == "auto" and core.scheduler.preemption is not None:
            res[mode]["decisions"] = [(d.kept_tokens, d.mode, d.swap_s, d.recompute_s)
                                      for d in list(core.scheduler.preemption.decisions)[:16]]
        del engine, core, outs
        free()
    best = max(("recompute", "swap"), key=lambda m: res[m]["output_tokens_per_s"])
    res["faster"], res["auto_vs_faster"] = best, res["auto"]["output_tokens_per_s"] / res[best]["output_tokens_per_s"]
    return res


def check_tiers(work: Path, device: str, quick: bool, gpu_name: str = "") -> dict:
    dtype = "bfloat16" if device == "cpu" else "float32"  # the float path on the CPU
    small = build_model(work / "tiers-small", TINY if quick else SMOLLM2, torch.float32, 0, device)
    out = {"outputs": check_outputs(small, device, dtype, quick)}
    big = work / "llama8b-shaped"
    if quick or not (big / "config.json").exists():
        big = build_model(work / "tiers-big", TINY if quick else LLAMA8B, torch.bfloat16, 0, device, std=0.02)
    speed_dtype = "bfloat16"
    out["load_rate"] = load_rate(big, device, speed_dtype, gpu_name, quick)
    out["decode_saves"] = decode_saves(big, device, speed_dtype, quick)
    out["returning_turn"] = returning_turn(big, device, speed_dtype, quick)
    out["swap_vs_recompute"] = swap_vs_recompute(big, device, speed_dtype, quick)
    return out
