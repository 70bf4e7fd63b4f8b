"""Time a Llama-shaped decoder's steps on a CUDA GPU: samples for the simulator's GPU cost model.

The simulator prices a step on a catalog GPU with the planner's roofline
(:mod:`pagedkv.sim.cost`); how far real kernels fall short of it on a GPU can only be
measured on one. This script needs torch alone (it runs on a bare GPU machine, without
pagedkv installed): it builds a decoder of a planner catalog model's shape
(``src/pagedkv/planner/data/models/*.json``: layers, heads, KV heads, hidden and FFN
sizes, vocabulary) with random bf16 weights, and times

- decode steps: ``batch`` sequences of ``context`` cached tokens each compute one token
  (RMSNorm, fused QKV, RoPE, KV write, attention over the cache, o_proj, SwiGLU MLP, LM
  head over every row, argmax);
- prefill steps: ``batch`` prompts of ``tokens`` each, causal attention, LM head over the
  last row of each;

each captured once in a CUDA graph and replayed (launch overhead out, as vLLM's decode
graphs do), and a few eagerly (launch overhead in). Attention is
``torch.nn.functional.scaled_dot_product_attention`` over a contiguous per-sequence cache
(torch picks its flash kernel), not a paged one: the bytes and FLOPs are the same, the
block-table indirection is not measured. Also measured in the same run: a device-to-device
copy, a bf16 GEMV over 4 GiB of weights and an 8192^3 bf16 matrix product (the ceilings).

    python3 benchmarks/gpu_step_profile.py --model llama-3-8b --model llama-3-70b:tp4 --output h200.json
    python3 benchmarks/gpu_step_profile.py --model smollm2-135m-instruct --device cpu --dtype float32 --quick

Output: JSON with the device, torch version, ceilings and one record per step
(``kind, batch, context, tokens, sampled, seconds`` (median) and ``all_seconds``);
``benchmarks/gpu_step_fit.py`` turns it into the simulator's efficiency factors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from gpu_step_model import Decoder, load_shape

DECODE = [(b, c) for b in (1, 4, 16, 64, 128, 256) for c in (128, 1024, 4096)] + [(1, 16384), (8, 16384), (1, 32768)]
PREFILL = [(1, 128), (1, 512), (1, 2048), (1, 8192), (4, 2048), (8, 512)]
QUICK_DECODE, QUICK_PREFILL = [(1, 16), (4, 64)], [(1, 32), (2, 16)]


def timer(device: torch.device):
    """A function timing ``fn()`` ``n`` times: seconds of each call (CUDA events on a GPU)."""
    def run(fn, n: int) -> list[float]:
        out = []
        for _ in range(n):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
        return out
    return run


def graphed(fn, device: torch.device):
    """``fn`` captured in a CUDA graph (after warm-up on a side stream); ``fn`` itself off a GPU."""
    if device.type != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def ceilings(device: torch.device, dtype: torch.dtype, quick: bool) -> dict:
    """Copy bandwidth (bytes read + written), GEMV read rate and matrix rate, best of the runs."""
    run, n = timer(device), 1 << (22 if quick else 31)  # elements: 2^31 bf16 = 4 GiB
    x = torch.randn(n, device=device, dtype=dtype)
    y = torch.empty_like(x)
    copy = min(run(lambda: y.copy_(x), 10))
    y = None  # freed
    cols = 8192
    w, v = x.view(n // cols, cols), torch.randn(cols, device=device, dtype=dtype)
    gemv = min(run(lambda: torch.mv(w, v), 10))
    x = w = None  # freed
    m = 1024 if quick else 8192
    a, b = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(2))
    run(lambda: a @ b, 3)
    mm = statistics.median(run(lambda: a @ b, 10))
    size = n * torch.finfo(dtype).bits // 8
    return {"copy_bytes_per_s": 2 * size / copy, "gemv_read_bytes_per_s": size / gemv,
            "matmul_flops_per_s": 2 * m ** 3 / mm, "matmul_shape": m, "buffer_bytes": size}


def profile(model: Decoder, shapes, kind: str, device, graphs: bool, repeats: int) -> list[dict]:
    run, out = timer(device), []
    for batch, length in shapes:
        if not model.fits(batch, length + 1):
            print(f"skip {kind} {batch}x{length}: over the KV pool", flush=True)
            continue
        make = model.decode_step if kind == "decode" else model.prefill_step
        step = make(batch, length)
        try:
            step()
        except RuntimeError as e:  # no fast kernel for enable_gqa: repeat the KV heads instead
            if kind != "prefill" or model.expand_kv:
                raise
            print(f"prefill with enable_gqa failed ({str(e)[:160]}); repeating KV heads", flush=True)
            model.expand_kv, step = True, make(batch, length)
        fn = graphed(step, device) if graphs else step
        run(fn, 2)
        t = run(fn, repeats)
        tokens = batch if kind == "decode" else batch * length
        rec = {"kind": kind, "graph": graphs and device.type == "cuda", "batch": batch,
               "context": length if kind == "decode" else 0, "tokens": tokens, "sampled": batch,
               "expand_kv": model.expand_kv and kind == "prefill",
               "seconds": statistics.median(t), "all_seconds": t}
        print(f"{kind:7s} graph={rec['graph']!s:5s} batch {batch:4d} x {length:6d}: "
              f"{1e3 * rec['seconds']:9.3f} ms", flush=True)
        out.append(rec)
        del fn, step
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append",
                   help="catalog model name, NAME:tpN for one rank of N (repeatable; default: llama-3-8b)")
    p.add_argument("--models-dir", default=str(Path(__file__).resolve().parents[1] / "src/pagedkv/planner/data/models"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-pool-gib", type=float, default=40.0, help="KV pool per model, GiB (default: 40)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test off a GPU)")
    p.add_argument("--output", required=True)
    a = p.parse_args()
    if a.repeats < 1 or not a.kv_pool_gib > 0:
        p.error("--repeats must be >= 1 and --kv-pool-gib > 0")
    for name in a.model or []:
        base, sep, tp = name.partition(":tp")
        if sep and not (tp.isdigit() and int(tp) >= 1):
            p.error(f"--model {name}: NAME or NAME:tpN with N >= 1")
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": a.dtype, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "ceilings": ceilings(device, dtype, a.quick), "models": {}}
    print(json.dumps(result["ceilings"]), flush=True)
    decode, prefill = (QUICK_DECODE, QUICK_PREFILL) if a.quick else (DECODE, PREFILL)
    for name in a.model or ["llama-3-8b"]:
        base, _, tp = name.partition(":tp")
        shape = load_shape(Path(a.models_dir) / f"{base}.json", int(tp or 1))
        model = Decoder(shape, dtype, device, pool_bytes=int(a.kv_pool_gib * 2 ** 30))
        steps = profile(model, decode, "decode", device, True, a.repeats)
        steps += profile(model, prefill, "prefill", device, True, a.repeats)
        steps += profile(model, decode[::4], "decode", device, False, a.repeats)
        result["models"][name] = {"shape": shape, "steps": steps}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        Path(a.output).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
