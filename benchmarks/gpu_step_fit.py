"""Fit the simulator's cost model to GPU steps timed by ``gpu_step_profile.py``; check it on held-out models.

Each timed step becomes the simulator's four roofline terms on a catalog device
(:meth:`pagedkv.sim.cost.StepCost.phases`: weight bytes and KV bytes over the datasheet
bandwidth, projection and attention FLOPs over the datasheet bf16 rate), counted by the
planner's own code for the step's shape (:func:`pagedkv.planner.roofline.chunk_work`,
full attention: the profiled decoder has no sliding windows). The factors are fitted with
:func:`pagedkv.sim.fit.fit` (the calibration's fit) on ``--fit-model``'s CUDA-graph steps;
every model's steps are then priced with the plain roofline and with the fitted factors.

    python benchmarks/gpu_step_fit.py benchmarks/results/h200_gpu_steps.json --gpu h200 \\
        --fit-model llama-3-8b [--json OUT.json] [--bundle src/pagedkv/planner/data/gpu_fits.json]

``--bundle`` fits every model in the result (or those ``--bundle-models`` names) on its own
steps and writes them into the simulator's bundled fits (``pagedkv simulate --efficiency
GPU/MODEL``), one per model, named ``GPU/MODEL`` (``llama-3-70b:tp4`` becomes
``llama-3-70b-tp4``); fits already in the file under other names are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from pagedkv.planner.hardware import get_device
from pagedkv.planner.models import load_model
from pagedkv.planner.roofline import chunk_work, config_cost
from pagedkv.sim.cost import Efficiency, StepCost
from pagedkv.sim.fit import fit


def step_cost(name: str, device) -> StepCost:
    """``name`` (``MODEL`` or ``MODEL:tpN``, one rank) in bf16 on ``device``, plain roofline."""
    base, _, tp = name.partition(":tp")
    tp = int(tp or 1)
    m = load_model(base)
    return StepCost(config_cost(m, m.kv_spec("bfloat16", 16, tp), "bfloat16", tp), device, "bfloat16")


def phases(cost: StepCost, rec: dict) -> tuple[float, float, float, float]:
    if rec["kind"] == "decode":
        work = chunk_work([(rec["context"], 1)] * rec["batch"], rec["batch"])
    else:
        work = chunk_work([(0, rec["tokens"] // rec["batch"])] * rec["batch"], rec["batch"])
    return cost.phases(work)


def label(rec: dict) -> str:
    n = rec["context"] if rec["kind"] == "decode" else rec["tokens"] // rec["batch"]
    return f"{rec['kind']} {rec['batch']}x{n}"


def evaluate(result: dict, device, eff: Efficiency) -> dict:
    """Per model: each graph step's measured, roofline and fitted seconds."""
    out = {}
    for name, entry in result["models"].items():
        plain = step_cost(name, device)
        fitted = StepCost(plain.cost, device, "bfloat16", eff)
        rows = []
        for rec in (r for r in entry["steps"] if r["graph"]):
            ph = phases(plain, rec)
            rows.append({"step": label(rec), "measured_s": rec["seconds"],
                         "roofline_s": plain.seconds_of(ph, rec["batch"], rec["tokens"]),
                         "fitted_s": fitted.seconds_of(ph, rec["batch"], rec["tokens"])})
        errs = [abs(r["fitted_s"] / r["measured_s"] - 1) for r in rows]
        out[name] = {"steps": rows, "fitted_median_abs_rel_error": statistics.median(errs),
                     "fitted_max_abs_rel_error": max(errs),
                     "roofline_over_measured_median":
                         statistics.median(r["roofline_s"] / r["measured_s"] for r in rows)}
    return out


def fit_model(result: dict, name: str, device) -> Efficiency:
    cost = step_cost(name, device)
    recs = [r for r in result["models"][name]["steps"] if r["graph"]]
    if len(recs) < 5:
        raise SystemExit(f"{name}: {len(recs)} CUDA-graph steps in the result; a fit needs at least 5 "
                         "(profiles made off a GPU have none)")
    cols = list(zip(*(phases(cost, r) for r in recs)))
    f = fit(*cols, [r["batch"] for r in recs], [r["seconds"] for r in recs])
    return Efficiency(memory=f.memory, compute=f.compute, kv_read=f.kv_read, attention=f.attention,
                      step_overhead_s=f.step_overhead_s, request_overhead_s=f.request_overhead_s,
                      source=f"fitted to {len(recs)} CUDA-graph steps of a {name}-shaped torch decoder on "
                             f"{result['device']} (torch {result['torch']}, {result['date']})")


def bundle(result: dict, gpu: str, device, raw: str, models: list[str] | None = None,
           existing: dict | None = None) -> dict:
    """Each model's own fit (all in ``result``, or ``models``), as ``pagedkv.sim.gpu_fits``
    reads them, merged into ``existing`` (same names replaced)."""
    fits = []
    for name in models or result["models"]:
        eff = fit_model(result, name, device)
        e = evaluate({**result, "models": {name: result["models"][name]}}, device, eff)[name]
        fits.append({"name": f"{gpu}/{name.replace(':tp', '-tp')}", "gpu": gpu, "model": name,
                     "efficiency": eff.to_dict(), "median_abs_rel_error": round(e["fitted_median_abs_rel_error"], 4),
                     "max_abs_rel_error": round(e["fitted_max_abs_rel_error"], 4), "raw": raw})
    new = {f["name"] for f in fits}
    kept = [f for f in (existing or {}).get("fits", []) if f["name"] not in new]
    return {"about": "Cost-model factors fitted to CUDA-graph steps of plain-torch decoders "
                     "(benchmarks/gpu_step_profile.py, benchmarks/gpu_step_fit.py --bundle); see BENCHMARKS.md",
            "fits": kept + fits}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result")
    p.add_argument("--gpu", default="h200")
    p.add_argument("--fit-model", default="llama-3-8b")
    p.add_argument("--json", help="write the factors and every step's prices here")
    p.add_argument("--bundle", help="write every model's own fit into this file (the simulator's bundled fits)")
    p.add_argument("--bundle-models", help="with --bundle: only these models of the result, comma-separated")
    a = p.parse_args()
    result, device = json.load(open(a.result)), get_device(a.gpu)
    eff = fit_model(result, a.fit_model, device)
    print(f"{result['device']}: fitted on {a.fit_model}: memory x{eff.memory:.3f}, compute x{eff.compute:.3f}, "
          f"kv_read x{eff.kv_read:.3f}, attention x{eff.attention:.3f}, +{1e3 * eff.step_overhead_s:.3f} ms/step, "
          f"+{1e6 * eff.request_overhead_s:.2f} us/request")
    c = result["ceilings"]
    print(f"ceilings measured: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, GEMV read "
          f"{c['gemv_read_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {c['matmul_shape']}^3 product "
          f"{c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s; datasheet {device.bandwidth / 1e12:.2f} TB/s, "
          f"{device.flops_16 / 1e12:.0f} TFLOP/s")
    ev = evaluate(result, device, eff)
    for name, e in ev.items():
        print(f"\n{name}{' (fitted on)' if name == a.fit_model else ' (held out)'}: fitted error median "
              f"{100 * e['fitted_median_abs_rel_error']:.1f}%, max {100 * e['fitted_max_abs_rel_error']:.1f}%; "
              f"roofline / measured median {e['roofline_over_measured_median']:.2f}")
        for r in e["steps"]:
            print(f"  {r['step']:18s} measured {1e3 * r['measured_s']:8.3f} ms  roofline {1e3 * r['roofline_s']:8.3f}"
                  f" ({r['roofline_s'] / r['measured_s']:.2f})  fitted {1e3 * r['fitted_s']:8.3f}"
                  f" ({100 * (r['fitted_s'] / r['measured_s'] - 1):+.1f}%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"efficiency": eff.to_dict(), "models": ev}, f, indent=1)
    if a.bundle:
        existing = json.load(open(a.bundle)) if os.path.exists(a.bundle) else None
        models = a.bundle_models.split(",") if a.bundle_models else None
        merged = bundle(result, a.gpu, device, a.result, models, existing)
        with open(a.bundle, "w") as f:
            json.dump(merged, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
