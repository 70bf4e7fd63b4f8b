"""The engine's speed on a GPU, for ``gpu_check.py``: a Llama-3-8B-shaped model with random
bf16 weights made on the device (the catalog config; nothing downloaded), HF transformers
``generate`` with a static cache timed on it first, then saved and loaded by pagedkv:

- single-stream decode at 1K context, CUDA graphs on and off: the bytes a step reads
  (weights + KV) over its time, against the measured HBM read rate;
- pure decode steps of 64 and 256 requests at 1K context (every request already
  prefilled): output tokens per second and the share of the step's roofline;
- an 8K-token prompt's TTFT: its FLOPs over the measured bf16 matrix rate;
- ``pagedkv plan --activation-peak`` against the pool the engine sized.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from gpu_check_engine import TINY, build_model, free, llm, prompts

from pagedkv import SamplingParams

LLAMA8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=16384, rope_theta=500000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=False)
CATALOG = {"H100 PCIe": "h100-pcie", "H100": "h100-sxm", "H200": "h200", "A100-SXM4-40GB": "a100-40gb",
           "A100": "a100-80gb-sxm4", "L40S": "l40s", "L4": "l4", "RTX 4090": "rtx-4090"}


def catalog_gpu(name: str) -> str | None:
    """The planner catalog's entry for a CUDA device name, or None."""
    return next((v for k, v in CATALOG.items() if k in name), None)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_tpot(hf, vocab: int, batch: int, ctx: int, n_out: int, device: str) -> float:
    """HF ``generate`` (static cache, SDPA) over ``batch`` prompts of ``ctx`` tokens: seconds
    per step after the first token."""
    ids = torch.randint(3, vocab, (batch, ctx), device=device)

    def run(n: int) -> float:
        _sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, cache_implementation="static", pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t

    run(2)  # warm-up
    first, full = run(1), run(n_out)
    return (full - first) / (n_out - 1)


def decode_step_seconds(engine, batch: list[dict], steps: int, device: str) -> float:
    """Median seconds of a pure decode step of ``batch`` (timed once every request has its
    first token, so no prefill chunk shares a step); the requests are aborted after."""
    longest = max(len(p["prompt_token_ids"]) for p in batch)
    params = SamplingParams(max_tokens=engine.max_model_len - longest, temperature=0.0, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(len(batch))]
    for rid, p in zip(ids, batch):
        engine.add_request(p, params, rid)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in engine.step() if o.token_ids)
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return sorted(times)[len(times) // 2]


def roofline_seconds(weight_bytes: int, matmul_params: int, kv_bytes_per_token: int, batch: int, ctx: int,
                     shape: dict, ceilings: dict) -> float:
    """A decode step's floor: weights and the batch's KV read once at the HBM read rate, or
    its FLOPs (projections and attention) at the matrix rate, whichever is longer."""
    heads, head_dim = shape["num_attention_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    flops = 2 * matmul_params * batch + 4 * shape["num_hidden_layers"] * heads * head_dim * ctx * batch
    moved = weight_bytes + kv_bytes_per_token * ctx * batch
    return max(moved / ceilings["gemv_read_bytes_per_s"], flops / ceilings["matmul_flops_per_s"])


def time_engine(work: Path, device: str, quick: bool, ceilings: dict, gpu_name: str = "") -> dict:
    from pagedkv import plan

    shape = TINY if quick else LLAMA8B
    ctx, n_out, long_n, batches = (16, 8, 64, (2, 4)) if quick else (1024, 128, 8192, (64, 256))
    folder, hf = build_model(work / "llama8b-shaped", shape, torch.bfloat16, 0, device, std=0.02, keep=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    matmul_params = sum(p.numel() for p in hf.parameters()) - hf.get_input_embeddings().weight.numel()
    rows: dict = {"model": "llama-3-8b-shaped" if not quick else "tiny", "weight_bytes": weight_bytes,
                  "hf_static_cache_tpot_s": {b: hf_tpot(hf, shape["vocab_size"], b, ctx, 32 if b > 1 else n_out,
                                                        device) for b in (1, batches[0])}}
    del hf
    free()
    engine_llm = llm(folder, device, gpu_memory_utilization=0.9, max_num_seqs=256, max_num_batched_tokens=long_n,
                     max_model_len=long_n + 64)
    engine = engine_llm.engine
    mem = engine.parts.memory
    rows["num_blocks"], rows["memory_profile"] = engine.kv_manager.pool.num_blocks, repr(mem)
    if mem is not None and catalog_gpu(gpu_name):
        rows["plan_num_blocks"] = plan(model=str(folder), gpu=catalog_gpu(gpu_name), gpu_memory_utilization=0.9,
                                       activation_peak=mem.activation_peak_bytes + mem.non_torch_bytes).num_blocks
    bpt = engine.parts.kv_spec.bytes_per_token
    one = prompts(1, [ctx], shape["vocab_size"], 2)
    runner, graphs = engine.core.runner, engine.core.runner.graphs
    for mode in ("graphs", "eager"):
        runner.graphs = graphs if mode == "graphs" else None  # the same engine, its decode steps eager
        step = decode_step_seconds(engine, one, 32 if not quick else 4, device)
        floor = roofline_seconds(weight_bytes, matmul_params, bpt, 1, ctx, shape, ceilings)
        rows[f"single_stream_{mode}"] = {"step_s": step, "tokens_per_s": 1 / step,
                                         "of_hbm_read_rate": (weight_bytes + bpt * ctx) / step
                                         / ceilings["gemv_read_bytes_per_s"], "of_roofline": floor / step}
    runner.graphs = graphs
    for b in batches:
        step = decode_step_seconds(engine, prompts(b, [ctx], shape["vocab_size"], 3 + b), 16 if not quick else 3,
                                   device)
        floor = roofline_seconds(weight_bytes, matmul_params, bpt, b, ctx, shape, ceilings)
        rows[f"batch{b}"] = {"step_s": step, "output_tokens_per_s": b / step, "of_roofline": floor / step}
    hf_b = rows["hf_static_cache_tpot_s"][batches[0]]
    rows[f"batch{batches[0]}"]["vs_hf_static_cache"] = hf_b / rows[f"batch{batches[0]}"]["step_s"]
    long = SamplingParams(max_tokens=1)
    engine_llm.generate(prompts(1, [long_n], shape["vocab_size"], 4), long)  # warm-up at this shape
    ttft = engine_llm.generate(prompts(1, [long_n], shape["vocab_size"], 5), long)[0].ttft
    heads, head_dim = shape["num_attention_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    flops = 2 * matmul_params * long_n + 2 * shape["num_hidden_layers"] * heads * head_dim * long_n * (long_n + 1)
    rows["prefill"] = {"tokens": long_n, "ttft_s": ttft,
                       "of_matmul_rate": flops / ttft / ceilings["matmul_flops_per_s"]}
    del engine, engine_llm, runner, graphs
    free()
    return rows
