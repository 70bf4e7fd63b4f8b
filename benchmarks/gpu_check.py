"""pagedkv's device check: one script, run first when a session has a GPU (issue 52).

In order, each section on its own (a failure is recorded and the next one runs):

1. ``env``: torch, Triton, the device, its memory and multiprocessors;
2. ``ceilings``: device-to-device copy rate and the bf16 matrix rate on random data
   (``gpu_step_profile.ceilings``), the denominators of every ratio below;
3. ``kernels``: the Triton paged-attention kernel against the pure-torch reference at real
   sizes (Llama-3-8B heads, 8K contexts, every page dtype, flash-decoding splits, MQA with a
   padded head_dim, Gemma-2's window + sinks + softcap): ``gpu_check_kernels``;
4. ``sanitize``: the kernel's cases again under ``compute-sanitizer --tool memcheck``;
5. ``engine``: a SmolLM2-shaped and a small GQA Llama-shaped model with seeded random
   weights built here: the GPU engine's fp32 greedy tokens against the CPU engine's (on the
   machine's own cores) and HF transformers', eager and through CUDA graphs, the prefix
   cache, chunked prefill and a small pool; bf16 against fp32 teacher-forced; fp8 pages:
   ``gpu_check_engine``;
6. ``kernel_speed``: decode attention against the copy ceiling and torch's SDPA over
   contiguous KV, bf16 against fp8 pages at 16K, an 8K causal prefill against the matrix rate;
7. ``engine_speed``: a Llama-3-8B-shaped model (bf16, made on the device): single-stream
   decode with CUDA graphs and eagerly, 64 and 256 requests' decode steps, an 8K prompt's
   TTFT, each against its roofline; HF ``generate`` (static cache) beside it; the planner's
   ``num_blocks`` against the engine's: ``gpu_check_speed``;
8. ``tiers`` (issue 54): the CPU tier and swap with the cache in GPU memory: outputs equal
   to device prefix hits and to no preemption, block loads against a pinned copy, decode
   steps with saves against none, a returning turn's TTFT against recompute:
   ``gpu_check_tiers``.

Writes ``gpu_check.json`` (everything) and ``gpu_check.txt`` (the table printed last) to
``--out`` (default: ``$OUT`` when set, else ``benchmarks/results``). ``--quick`` runs tiny
shapes, on the CPU where there is no GPU (Triton interpreted), and writes
``gpu_check_quick.json``/``.txt`` instead: it checks the script, not a device (its times
mean nothing). Needs torch, Triton, transformers, tokenizers and safetensors; run from the
repository root without installing pagedkv::

    PYTHONPATH=src python3 benchmarks/gpu_check.py --commit $(git rev-parse --short HEAD)
    PYTHONPATH=src python3 benchmarks/gpu_check.py --quick   # on a CPU, a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
SECTIONS = ("env", "ceilings", "kernels", "sanitize", "engine", "kernel_speed", "engine_speed", "tiers")


def env_info(device: str) -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
            "device": device, "cpu": _cpu_name()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info |= {"gpu": p.name, "multiprocessors": p.multi_processor_count, "memory_total_bytes": total,
                 "memory_free_bytes": free, "capability": f"{p.major}.{p.minor}", "cuda": torch.version.cuda}
    return info


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def sanitize(quick: bool) -> dict:
    """The kernel's sanitize cases in a child process under compute-sanitizer's memcheck."""
    tool = "compute-sanitizer"
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, __file__, "--sanitize-child"]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace").strip().splitlines()[-6:]
        return {"returncode": None, "seconds": time.perf_counter() - t, "tail": tail, "ok": False,
                "timed_out": True}
    tail = (r.stdout + r.stderr).strip().splitlines()[-6:]
    return {"returncode": r.returncode, "seconds": time.perf_counter() - t, "tail": tail,
            "ok": r.returncode == 0 and any("ERROR SUMMARY: 0 errors" in line for line in tail)}


def sanitize_child() -> int:
    from gpu_check_kernels import SANITIZE_CASES, check_case

    rows = [check_case(c, "cuda", i) for i, c in enumerate(SANITIZE_CASES)]
    torch.cuda.synchronize()
    print(json.dumps(rows))
    return 0 if all(r["ok"] for r in rows) else 1


def run_sections(args, device: str, out: dict, save) -> None:
    from gpu_check_engine import check_engine
    from gpu_check_kernels import check_kernels, time_kernels
    from gpu_check_speed import time_engine
    from gpu_check_tiers import check_tiers
    from gpu_step_profile import ceilings

    work = Path(tempfile.mkdtemp(prefix="pagedkv-gpu-check-"))
    steps = {
        "env": lambda: env_info(device),
        "ceilings": lambda: ceilings(torch.device(device), torch.bfloat16, args.quick),
        "kernels": lambda: check_kernels(device, args.quick),
        "sanitize": lambda: sanitize(args.quick),
        "engine": lambda: check_engine(work, device, args.quick),
        "kernel_speed": lambda: time_kernels(device, args.quick, out["ceilings"], 5 if args.quick else 50),
        "engine_speed": lambda: time_engine(work, device, args.quick, out["ceilings"],
                                            out.get("env", {}).get("gpu", "")),
        "tiers": lambda: check_tiers(work, device, args.quick, out.get("env", {}).get("gpu", "")),
    }
    start = time.perf_counter()
    for name in args.sections:
        if name == "sanitize" and (device != "cuda" or not _has("compute-sanitizer")):
            out[name] = {"skipped": "no GPU or no compute-sanitizer"}
            continue
        if time.perf_counter() - start > args.budget_s:  # the lease is short: leave the rest for a second call
            out[name] = {"skipped": f"past --budget-s {args.budget_s:g} s (run it with --sections {name})"}
            continue
        t = time.perf_counter()
        try:
            out[name] = steps[name]()
        except Exception as e:  # noqa: BLE001 - record it, run the next section
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        out.setdefault("seconds", {})[name] = round(time.perf_counter() - t, 1)
        print(f"[gpu_check] {name}: {out['seconds'][name]} s", flush=True)
        save()


def _has(tool: str) -> bool:
    from shutil import which

    return which(tool) is not None


def summary(out: dict) -> str:
    """The short table printed last (the device tool returns the output's end)."""
    lines = [f"pagedkv gpu_check {out.get('commit', '')} {out.get('env', {}).get('gpu', out.get('device'))}"
             + (" --quick: tiny shapes, the script checked, not a device (times mean nothing)" if out.get("quick")
                else "")]
    c = out.get("ceilings", {})
    if "copy_bytes_per_s" in c:
        lines.append(f"ceilings: copy {c['copy_bytes_per_s'] / 1e9:,.1f} GB/s, GEMV read "
                     f"{c['gemv_read_bytes_per_s'] / 1e9:,.1f} GB/s, bf16 matmul {c['matmul_flops_per_s'] / 1e12:,.3g} "
                     "TFLOP/s")
    for r in out.get("kernels", []) if isinstance(out.get("kernels"), list) else []:
        lines.append(f"kernel {r['case']:<30} rel_err {r['rel_err']:.2e} (< {r['tolerance']:g}) "
                     f"{'ok' if r['ok'] else 'FAIL'}")
    for r in out.get("kernel_speed", []) if isinstance(out.get("kernel_speed"), list) else []:
        ratio = r.get("of_copy_ceiling", r.get("of_matmul_ceiling"))
        lines.append(f"speed {r['kind']:<7} b{r['batch']:<3} ctx {r['context']:<6} {r['page_dtype']:<9} "
                     f"{r['seconds'] * 1e6:8.1f} us = {ratio:.2f} of ceiling; sdpa contiguous "
                     f"{r['sdpa_contiguous_bf16_seconds'] * 1e6:8.1f} us")
    for name in ("sanitize", "engine", "engine_speed", "tiers"):
        if name in out:
            body = {k: v for k, v in out[name].items() if k != "traceback"}
            lines.append(f"{name}: {json.dumps(_rounded(body), default=str)[:2500]}")
    errors = [k for k, v in out.items() if isinstance(v, dict) and "error" in v]
    lines.append(f"sections with errors: {', '.join(errors) or 'none'}; seconds {out.get('seconds')}")
    return "\n".join(lines)


def _rounded(x):
    """``x`` with its floats to 4 significant digits (for the printed table)."""
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes: check the script (on a CPU without a GPU)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--out", help="folder for gpu_check.json and .txt (default: $OUT, else benchmarks/results)")
    ap.add_argument("--commit", default="", help="the commit checked (recorded in the results)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no section after this many seconds (default: %(default)s; the device check "
                         "must fit its lease)")
    ap.add_argument("--sanitize-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sanitize_child:
        return sanitize_child()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not args.quick:
            ap.error("no GPU here: --quick checks the script on the CPU")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("PAGEDKV_ATTENTION", "triton")  # the float path's kernel on CPU tensors
    folder = Path(args.out or os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    out = {"commit": args.commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "quick": args.quick,
           "device": device}
    name = "gpu_check_quick" if args.quick else "gpu_check"

    def save() -> None:
        (folder / f"{name}.json").write_text(json.dumps(out, indent=1, default=str))

    run_sections(args, device, out, save)
    text = summary(out)
    (folder / f"{name}.txt").write_text(text + "\n")
    print(text)
    return 1 if any(isinstance(v, dict) and "error" in v for v in out.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
