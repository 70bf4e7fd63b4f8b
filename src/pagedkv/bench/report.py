"""Results: the JSON document, medians over repeats, ratios, goals, a table and a plot.

The JSON document (``SCHEMA``) has these top-level keys::

    schema, command, created, code, settings, machine, model, workload,
    runs      [{"system", "repeat", "metrics": {...}, "roofline": {...}, "load": {...}}, ...]
    skipped   {system: reason}
    summary   {system: {flattened metric: median over repeats}}
    best      {system: {flattened metric of its best run}}    (``best_by`` names the key)
    ratios    {name: {"per_repeat": [...], "median": x, "best_of_each": best / best}}
    goals     [{"name", "target", "direction", "measured", "met", "best", "met_by_best", "note"}]
    series    {system: {"waste": [...], "running": [...], "blocks_used": [...]}}  (last repeat)
    machine   measured ceilings (best of the start measurement and the per-run ``probes``),
              CPUs, threads, load averages; ``code``: git commit and locally modified files

Metric names in ``summary`` are flattened with dots (``ttft_s.p99``); seconds, tokens and
requests as named. Ratios are taken per repeat (systems of one repeat ran back to back)
and their median is reported, because these machines are shared and noisy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pagedkv.bench.metrics import median

SCHEMA = "pagedkv-bench/1"
REQUIRED_KEYS = ("schema", "command", "created", "settings", "machine", "model", "workload", "runs",
                 "skipped", "summary", "best", "ratios", "goals", "series")
RUN_KEYS = ("system", "repeat", "metrics", "roofline")
TABLE_METRICS = (
    ("output tok/s", "metrics.output_tokens_per_s", "{:.1f}"),
    ("total tok/s", "metrics.total_tokens_per_s", "{:.1f}"),
    ("req/s", "metrics.requests_per_s", "{:.3f}"),
    ("TTFT p50 s", "metrics.ttft_s.p50", "{:.2f}"),
    ("TTFT p99 s", "metrics.ttft_s.p99", "{:.2f}"),
    ("TPOT p50 ms", "metrics.tpot_s.p50", "ms"),
    ("ITL p99 ms", "metrics.itl_s.p99", "ms"),
    ("e2e p50 s", "metrics.e2e_s.p50", "{:.2f}"),
    ("e2e p99 s", "metrics.e2e_s.p99", "{:.2f}"),
    ("peak KV blocks", "metrics.peak_kv_blocks", "{:.0f}"),
    ("max running", "metrics.max_running", "{:.0f}"),
    ("preemptions", "metrics.preemptions", "{:.0f}"),
    ("KV waste", "metrics.waste", "%"),
    ("prefill tokens computed", "metrics.prefill_tokens_computed", "{:.0f}"),
    ("others' CPU share (load)", "load.others_cpu_share", "%"),
    ("roofline (own schedule)", "roofline.fraction", "%"),
    ("roofline (ideal batch)", "roofline.fraction_of_ideal", "%"),
    ("decode tok/s (1 stream)", "metrics.decode_tokens_per_s", "{:.1f}"),
    ("weight-read bound tok/s", "roofline.weight_read_tokens_per_s", "{:.1f}"),
    ("of weight-read bound", "roofline.fraction_of_weight_read", "%"),
    ("first request TTFT s", "metrics.first_ttft_s", "{:.2f}"),
    ("TTFT after first, mean s", "metrics.rest_ttft_s.mean", "{:.2f}"),
    ("TTFT after first, p50 s", "metrics.rest_ttft_s.p50", "{:.2f}"),
    ("cached prompt tokens (after first)", "metrics.rest_cached_tokens", "{:.0f}"),
)


def new_result(command: str, settings: dict) -> dict:
    return {"schema": SCHEMA, "command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "code": code_version(), "settings": settings, "machine": {}, "model": {}, "workload": {},
            "runs": [], "skipped": {}, "summary": {}, "best": {}, "ratios": {}, "goals": [], "series": {}}


def code_version() -> dict:
    """The git commit of the source tree and the files changed since it (``None`` outside git)."""
    import subprocess

    src = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "."], cwd=src,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": None}
    if head.returncode:
        return {"commit": None, "modified": None}
    return {"commit": head.stdout.strip(), "modified": [ln[3:] for ln in dirty.stdout.splitlines()]}


def flatten(d: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; only numbers are kept."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flatten(v, key + ".")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


def summarize(result: dict, best_key: str = "metrics.output_tokens_per_s", higher: bool = True) -> None:
    """Fill ``summary`` (per system, the median of every numeric run field over repeats)
    and ``best`` (per system, the fields of its run with the best ``best_key``: noise on a
    shared machine only ever slows a run down, so the best run is the least disturbed)."""
    by_system: dict[str, list[dict]] = {}
    for run in result["runs"]:
        flat = flatten({k: run[k] for k in run if k not in ("system", "repeat")})
        by_system.setdefault(run["system"], []).append(flat)
    result["best"] = {}
    for system, runs in by_system.items():
        keys = sorted({k for r in runs for k in r})
        result["summary"][system] = {k: median(r.get(k) for r in runs) for k in keys}
        scored = [r for r in runs if r.get(best_key) is not None]
        if scored:
            pick = max if higher else min
            result["best"][system] = pick(scored, key=lambda r: r[best_key]) | {"best_by": best_key}


def add_ratio(result: dict, name: str, num: str, den: str, key: str) -> float | None:
    """Per-repeat ratio ``num.key / den.key`` and its median, stored under ``ratios[name]``."""
    runs = {(r["system"], r["repeat"]): flatten(r) for r in result["runs"]}
    per = []
    for (system, rep), m in sorted(runs.items(), key=lambda x: x[0][1]):
        if system == num and (den, rep) in runs:
            a, b = m.get(key), runs[(den, rep)].get(key)
            if a is not None and b:
                per.append(a / b)
    best = result.get("best", {})
    a, b = best.get(num, {}).get(key), best.get(den, {}).get(key)
    result["ratios"][name] = {"numerator": num, "denominator": den, "metric": key, "per_repeat": per,
                              "median": median(per), "best_of_each": a / b if a is not None and b else None}
    return median(per)


def add_goal(result: dict, name: str, measured: float | None, target: float, higher_is_better: bool = True,
             note: str = "", best: float | None = None) -> None:
    """Record a goal; ``measured`` is the median, ``best`` the best-of-repeats figure (if any).
    ``met`` judges the median; ``met_by_best`` the best figure."""
    def judge(x):
        return None if x is None else (x >= target if higher_is_better else x < target)
    result["goals"].append({"name": name, "target": target, "measured": measured, "met": judge(measured),
                            "best": best, "met_by_best": judge(best),
                            "direction": ">=" if higher_is_better else "<", "note": note})


def validate(result: dict) -> None:
    """Raise ``ValueError`` if ``result`` lacks a key of the schema."""
    missing = [k for k in REQUIRED_KEYS if k not in result]
    missing += [f"runs[{i}].{k}" for i, r in enumerate(result["runs"]) for k in RUN_KEYS if k not in r]
    if missing or result["schema"] != SCHEMA:
        raise ValueError(f"not a {SCHEMA} result; missing: {', '.join(missing) or 'schema'}")


def write_json(result: dict, path: Path) -> None:
    validate(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "%":
        return f"{100 * value:.1f}%"
    if spec == "ms":
        return f"{1000 * value:.1f}"
    return spec.format(value)


def markdown_table(result: dict, section: str = "summary") -> str:
    """One column per system, one row per headline metric: medians over repeats
    (``section="summary"``) or each system's best run (``"best"``)."""
    table = result.get(section, {})
    systems = list(table)
    rows = ["| metric | " + " | ".join(systems) + " |", "| --- |" + " ---: |" * len(systems)]
    for label, key, spec in TABLE_METRICS:
        vals = [table[s].get(key) for s in systems]
        if any(v is not None for v in vals):
            rows.append(f"| {label} | " + " | ".join(_fmt(v, spec) for v in vals) + " |")
    return "\n".join(rows)


BUSY_SHARE = 0.10  # others' CPU share of a run above which its goal verdicts get a caution


def goals_text(result: dict) -> str:
    """One line per goal; a caution after them where other processes used more than
    :data:`BUSY_SHARE` of the CPUs in a run (they slow the runs and the machine probe that
    the roofline fractions divide by, so a verdict can flip either way)."""
    lines = []
    for g in result["goals"]:
        state = {True: "MET", False: "NOT MET", None: "not measured"}[g["met"]]
        m = "-" if g["measured"] is None else f"{g['measured']:.3g}"
        best = "" if g.get("best") is None else (f"; best of repeats {g['best']:.3g}: "
                                                 f"{'MET' if g['met_by_best'] else 'NOT MET'}")
        lines.append(f"{g['name']}: median {m} (goal {g['direction']} {g['target']:g}) {state}{best}"
                     + (f" - {g['note']}" if g["note"] else ""))
    shares = [(r.get("load") or {}).get("others_cpu_share") for r in result["runs"]]
    busiest = max((x for x in shares if x is not None), default=None)
    if lines and busiest is not None and busiest > BUSY_SHARE:
        lines.append(f"caution: other processes used up to {100 * busiest:.0f}% of the CPUs during these runs; "
                     "they slow the runs and the machine probe the roofline fractions divide by, so these "
                     "verdicts may be off either way (rerun on a quiet machine)")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Throughput bars (with each system's roofline bound) and, where sampled, KV waste and
    running requests per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(result["summary"])
    series = {s: v for s, v in result["series"].items() if v.get("waste")}
    fig, axes = plt.subplots(1, 1 + 2 * bool(series), figsize=(5 + 9 * bool(series), 4), squeeze=False)
    ax = axes[0][0]
    tps = [result["summary"][s].get("metrics.output_tokens_per_s") or 0 for s in systems]
    ax.bar(systems, tps, color="tab:blue", label="measured")
    bound = [result["summary"][s].get("roofline.bound_output_tokens_per_s") for s in systems]
    ax.scatter([s for s, b in zip(systems, bound) if b], [b for b in bound if b], marker="_", s=900,
               color="tab:red", label="roofline bound")
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title(f"pagedkv bench {result['command']}")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", rotation=20)
    if series:
        for s, v in series.items():
            axes[0][1].plot([100 * w for w in v["waste"]], label=s)
            axes[0][2].plot(v["running"], label=s)
        axes[0][1].set(xlabel="engine step", ylabel="KV memory waste %", title="KV waste per step")
        axes[0][2].set(xlabel="engine step", ylabel="requests", title="requests running per step")
        axes[0][1].legend(fontsize=8)
        axes[0][2].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
