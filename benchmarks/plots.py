"""Rebuild BENCHMARKS.md's figures from the raw results in benchmarks/results/, running nothing else.

    python benchmarks/plots.py [--out benchmarks/results]

Each figure plots the raw file(s) its BENCHMARKS.md section's table was made from, and prints
the numbers that table shows so the two can be compared:

* ``llama_cpp_batch.png``: output tokens/s against batch size (one stream: decode tokens/s),
  pagedkv with ``--activation-dtype int8`` beside llama.cpp in the same run, with the ratio
  (median of per-repeat ratios) and issue 17's goal; left EPYC AVX-512, right EPYC AVX2
  (fp16 KV in the batches). Reads ``latency_a8_greedy_kernel_vs_llama_cpp.json``,
  ``throughput_a8_one_stream_16.json``, ``throughput64_a8_raw_buffers_vs_llama_cpp.json``,
  ``avx2_latency_int8_split.json``, ``avx2_throughput{16,64}_int8_fp16kv_split.json``.
* ``ttft_rate.png``: TTFT against request rate. Left, measured on EPYC AVX-512: the three
  online scenarios of the simulator's accuracy check (TTFT p50 of each real run, their median,
  and the simulation), ``sim_accuracy_avx512_2026-12-05_fourth.json``. Middle and right,
  simulated only: Llama-3-70B on H100s, colocated vs disaggregated, TTFT p90 and SLO
  attainment, ``sim_disagg.json``.
* ``sim_vs_real.png``: the simulator's error against the real engine's median, per scenario,
  for output tokens/s, TTFT p50 and TPOT p50 (as is, and drift-adjusted), with each real run's
  own distance from that median and issue 15's goal band;
  ``sim_accuracy_avx512_2026-12-05_fourth.json``.
* ``ppl_position.png``: perplexity per 4,096 positions over 40,960-token stretches of the
  novel, pooled over the four stretches (thin lines: each stretch), for the dense control,
  sinks + window and window only; ``ppl_by_position_*.txt`` (parsed by ppl_position_summary.py).
* ``needle.png``: passkey trials answered by depth and context length for dense attention,
  streaming, SnapKV and H2O; ``needle_*.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402
from ppl_position_summary import buckets  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"
DPI = 110
PAGED, LLAMA, SIM = "tab:blue", "tab:orange", "tab:green"


def load(name: str):
    with open(RESULTS / name, encoding="utf-8") as f:
        return json.load(f)


def save(fig, out: Path, name: str) -> None:
    path = out / name
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


# --- pagedkv vs llama.cpp by batch size (issue 17) ----------------------------------------------

AVX512_RUNS = [(1, "latency_a8_greedy_kernel_vs_llama_cpp.json"), (16, "throughput_a8_one_stream_16.json"),
               (64, "throughput64_a8_raw_buffers_vs_llama_cpp.json")]
AVX2_RUNS = [(1, "avx2_latency_int8_split.json"), (16, "avx2_throughput16_int8_fp16kv_split.json"),
             (64, "avx2_throughput64_int8_fp16kv_split.json")]
GOALS = {1: 1.0, 16: 2.0, 64: 4.0}  # issue 17: times llama.cpp


def bench_point(name: str) -> tuple[float, float, float]:
    """(pagedkv, llama.cpp, ratio) of one ``pagedkv bench --systems pagedkv,llama-cpp`` file:
    decode tok/s for ``latency``, output tok/s for ``throughput``; the ratio as the table
    prints it, the median of the per-repeat ratios."""
    d = load(name)
    key = "metrics.decode_tokens_per_s" if d["command"] == "latency" else "metrics.output_tokens_per_s"
    ratio = next(iter(d["ratios"].values()))["median"]
    return d["summary"]["pagedkv"][key], d["summary"]["llama-cpp"][key], ratio


def batch_panel(ax, runs, title: str) -> None:
    points = [(b, *bench_point(name)) for b, name in runs]
    xs = range(len(points))
    w = 0.38
    ax.bar([x - w / 2 for x in xs], [p[1] for p in points], w, color=PAGED, label="pagedkv")
    ax.bar([x + w / 2 for x in xs], [p[2] for p in points], w, color=LLAMA, label="llama.cpp (same run)")
    for x, (b, paged, llama, ratio) in zip(xs, points):
        ax.text(x - w / 2, paged, f"{paged:,.0f}\n{ratio:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.text(x + w / 2, llama, f"{llama:,.0f}", ha="center", va="bottom", fontsize=8)
        goal = GOALS[b] * llama
        ax.plot([x - w, x], [goal, goal], color="black", lw=1.5, ls="--",
                label="goal (1x / 2x / 4x llama.cpp)" if x == 0 else None)
        print(f"  {title.splitlines()[0]}, batch {b}: {paged:.1f} vs {llama:.1f} tok/s, {ratio:.2f}x")
    ax.set_xticks(list(xs), [f"{b} (one stream)" if b == 1 else str(b) for b, *_ in points])
    ax.set_xlabel("requests decoded together (batch size)")
    ax.set_ylabel("output tokens/s (one stream: decode tokens/s)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, max(max(p[1], GOALS[p[0]] * p[2]) for p in points) * 1.22)
    ax.legend(fontsize=8, loc="upper left")


def plot_llama_cpp_batch(out: Path) -> None:
    print("llama_cpp_batch.png (BENCHMARKS: issue 17, int8 activations; AVX2-only CPU)")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    batch_panel(axes[0], AVX512_RUNS, "EPYC AVX-512 (family 26), 2 vCPUs\n--activation-dtype int8, fp32 KV")
    batch_panel(axes[1], AVX2_RUNS, "EPYC AVX2 (family 25, Zen 3), 2 vCPUs\n"
                                    "--activation-dtype int8, fp16 KV in the batches")
    fig.suptitle(f"pagedkv vs llama.cpp by batch size: {MODEL} GGUF (--weight-dtype auto), 2 threads each")
    save(fig, out, "llama_cpp_batch.png")


# --- TTFT against request rate ------------------------------------------------------------------

SIM_ACCURACY = "sim_accuracy_avx512_2026-12-05_fourth.json"
DISAGG_STYLE = {"colocated x2": ("tab:gray", "--"), "1P1D": ("tab:purple", "--"),
                "colocated x3": ("tab:gray", "-"), "2P1D": ("tab:purple", "-")}


def online_scenarios(d: dict) -> list[tuple[float, dict]]:
    """(request rate, scenario) of the accuracy check's online scenarios, by rate (the rate
    is in the name: ``online-2.1``)."""
    rows = [(float(n.split("-", 1)[1]), s) for n, s in d["scenarios"].items() if n.startswith("online-")]
    return sorted(rows, key=lambda r: r[0])


def measured_ttft_panel(ax) -> None:
    rows = online_scenarios(load(SIM_ACCURACY))
    rates = [r for r, _ in rows]
    for rate, s in rows:
        ax.scatter([rate] * len(s["real_runs"]), [run["ttft_p50"] * 1e3 for run in s["real_runs"]],
                   color=PAGED, alpha=0.45, s=18, label="measured, each run" if rate == rates[0] else None)
        print(f"  measured, {rate} req/s: TTFT p50 {s['real']['ttft_p50']:.3f} s (median of "
              f"{len(s['real_runs'])}), simulated {s['cost_model']['ttft_p50']:.3f} s")
    ax.plot(rates, [s["real"]["ttft_p50"] * 1e3 for _, s in rows], "o-", color=PAGED,
            label="measured, median of 3 runs")
    ax.plot(rates, [s["cost_model"]["ttft_p50"] * 1e3 for _, s in rows], "s--", color=SIM,
            label="simulated (calibrated cost model)")
    ax.set_xlabel("request rate (req/s, Poisson; 0.15 / 0.4 / 0.7 of saturation)")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_ylim(0, None)
    ax.set_title(f"Measured: {MODEL}, EPYC AVX-512, 2 vCPUs\n32 arena-hard prompts, 64 output tokens", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def disagg_panels(ax_ttft, ax_slo) -> None:
    d = load("sim_disagg.json")
    rates = [row["rate"] for row in d["rows"]]
    for setup, (color, ls) in DISAGG_STYLE.items():
        gpus = 8 if setup in ("colocated x2", "1P1D") else 12
        label = f"{setup} ({gpus} GPUs)"
        ax_ttft.plot(rates, [row[setup]["ttft_p90_s"] for row in d["rows"]], marker="o", color=color, ls=ls,
                     label=label)
        ax_slo.plot(rates, [row[setup]["slo_attainment"] * 100 for row in d["rows"]], marker="o", color=color,
                    ls=ls, label=label)
        print(f"  simulated {setup}: " + ", ".join(
            f"{row['rate']:g}: {row[setup]['slo_attainment']:.0%} ({row[setup]['ttft_p90_s']:.2f} / "
            f"{row[setup]['tpot_p90_s'] * 1e3:.1f})" for row in d["rows"]))
    ax_ttft.axhline(d["ttft_slo_s"], color="red", lw=1, ls=":", label=f"TTFT SLO {d['ttft_slo_s']:g} s")
    ax_ttft.set_yscale("log")
    ax_ttft.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_ttft.set_ylabel("TTFT p90 (s, log scale)")
    ax_slo.set_ylabel("requests within the SLO (%)")
    ax_slo.set_ylim(-3, 105)
    slo = f"SLO: TTFT <= {d['ttft_slo_s']:g} s and TPOT <= {d['tpot_slo_s'] * 1e3:g} ms"
    for ax, what in ((ax_ttft, "TTFT p90"), (ax_slo, slo)):
        ax.set_xticks(rates)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(f"Simulated: {what}, Llama-3-70B, H100-SXM\nTP {d['tp']} per instance, plain roofline",
                     fontsize=10)
        ax.legend(fontsize=8, loc="upper left" if ax is ax_ttft else "lower left")


def plot_ttft_rate(out: Path) -> None:
    print("ttft_rate.png (BENCHMARKS: simulator against the real engine; where disaggregation pays)")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), layout="constrained")
    measured_ttft_panel(axes[0])
    disagg_panels(axes[1], axes[2])
    fig.suptitle("TTFT against request rate: measured on a CPU (left), simulated on GPUs (middle, right)")
    save(fig, out, "ttft_rate.png")


# --- simulated against measured (issue 15) ------------------------------------------------------

SIM_METRICS = [("output_tokens_per_s", "output tokens/s", 10), ("ttft_p50", "TTFT p50", 15),
               ("tpot_p50", "TPOT p50", 15)]  # key, label, issue 15's goal (within %)


def error_panel(ax, scenarios: dict, key: str, label: str, goal: float) -> None:
    names = list(scenarios)
    xs = range(len(names))
    w = 0.36
    raw = [scenarios[n]["cost_model_error"][key] * 100 for n in names]
    adj = [scenarios[n]["drift_adjusted_error"][key] * 100 for n in names]
    ax.axhspan(-goal, goal, color="0.92", zorder=0, label="issue 15's goal")
    ax.axhline(0, color="black", lw=0.8)
    ax.bar([x - w / 2 for x in xs], raw, w, color=SIM, label="simulated, as is")
    ax.bar([x + w / 2 for x in xs], adj, w, color="tab:olive", label="simulated, drift-adjusted")
    for x, n in zip(xs, names):
        median = scenarios[n]["real"][key]
        runs = [(r[key] / median - 1) * 100 for r in scenarios[n]["real_runs"]]
        ax.scatter([x] * len(runs), runs, color="black", marker="_", s=120, zorder=3,
                   label="each real run vs their median" if x == 0 else None)
    ticks = [f"online\n{n[7:]} req/s" if n.startswith("online-") else n.replace("-", "\n") for n in names]
    ax.set_xticks(list(xs), ticks, fontsize=8)
    ax.set_ylabel("difference from the real median (%)")
    ax.set_title(f"{label} (goal: within {goal:g}%)", fontsize=10)
    lim = max(goal + 3, *(abs(v) + 3 for v in raw + adj))
    ax.set_ylim(-lim, lim)
    print(f"  {label}: " + ", ".join(f"{n} {r:+.1f}% / {a:+.1f}%" for n, r, a in zip(names, raw, adj)))


def plot_sim_vs_real(out: Path) -> None:
    print("sim_vs_real.png (BENCHMARKS: simulator against the real engine on this CPU)")
    d = load(SIM_ACCURACY)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), layout="constrained")
    for ax, (key, label, goal) in zip(axes, SIM_METRICS):
        error_panel(ax, d["scenarios"], key, label, goal)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"Simulated against measured: {MODEL} on EPYC AVX-512, 2 vCPUs ({d['repeats']} real runs "
                 "a scenario; online at 0.79 / 2.1 / 3.68 req/s)")
    save(fig, out, "sim_vs_real.png")


# --- perplexity by position (issue 14) ----------------------------------------------------------

STRETCHES = {  # stretch: {setting: file}
    "chapters 1-8": {"dense": "ppl_by_position_dense_8191.txt", "streaming": "ppl_by_position_streaming_cache.txt",
                     "window": "ppl_by_position_window_only.txt"},
    **{f"chapters {c}": {s: f"ppl_by_position_ch{c}_{s}.txt" for s in ("dense", "streaming", "window")}
       for c in ("32-36", "54-62", "83-93")},
}
PPL_SETTINGS = {"dense": ("dense control (8,191-token windows)", "black"),
                "streaming": ("sinks + window (4 + 1,020, the default)", PAGED),
                "window": ("window only (1,024, no sinks)", "tab:red")}
BEYOND = 8192


def pooled(rows: list[list[tuple[int, float, int]]]) -> list[tuple[int, float]]:
    """Per bucket start, the perplexity over all stretches (exp of summed NLL over summed tokens)."""
    out = []
    for parts in zip(*rows):
        nll = sum(n * math.log(p) for _, p, n in parts)
        out.append((parts[0][0], math.exp(nll / sum(n for _, _, n in parts))))
    return out


def pooled_range(rows, lo: int, hi: int) -> float:
    parts = [r for stretch in rows for r in stretch if lo <= r[0] < hi]
    return math.exp(sum(n * math.log(p) for _, p, n in parts) / sum(n for _, _, n in parts))


def plot_ppl_position(out: Path) -> None:
    print("ppl_position.png (BENCHMARKS: past the model's positions)")
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    for setting, (label, color) in PPL_SETTINGS.items():
        rows = [buckets(str(RESULTS / files[setting])) for files in STRETCHES.values()]
        for stretch in rows:
            ax.plot([s / 1000 for s, _, _ in stretch], [p for _, p, _ in stretch], color=color, lw=0.7, alpha=0.3)
        pts = pooled(rows)
        ax.plot([s / 1000 for s, _ in pts], [p for _, p in pts], "o-", color=color, lw=2, label=label)
        first, later = pooled_range(rows, 0, 4096), pooled_range(rows, BEYOND, 10**9)
        print(f"  {setting}: pooled {first:.2f} / {later:.2f} ({(later / first - 1) * 100:+.1f}%)")
    ax.axvline(BEYOND / 1000, color="0.4", ls=":", lw=1)
    ax.text(BEYOND / 1000 + 0.3, ax.get_ylim()[0] + 0.5, "the model's 8,192 trained positions end", fontsize=8,
            va="bottom", color="0.3")
    ax.set_xlabel("position in the sequence (thousands of tokens; each point starts a 4,096-token bucket)")
    ax.set_ylabel("perplexity of the bucket")
    ax.set_title(f"Perplexity by position, {MODEL}, fp32 KV, EPYC AVX-512\n"
                 "pooled over four 40,960-token stretches of The Count of Monte Cristo (thin lines: each stretch)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    save(fig, out, "ppl_position.png")


# --- passkey retrieval (issue 14) ---------------------------------------------------------------

NEEDLE_FILES = [("dense", "needle_dense.jsonl"), ("streaming, 1,024-token cache", "needle_streaming1024.jsonl"),
                ("SnapKV 12.5%", "needle_snapkv0.125.jsonl"), ("SnapKV 25%", "needle_snapkv0.25.jsonl"),
                ("SnapKV 50%", "needle_snapkv0.5.jsonl"), ("H2O 25%", "needle_h2o0.25.jsonl"),
                ("H2O 50%", "needle_h2o0.5.jsonl")]
NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", ["#f4a582", "#fddbc7", "#a6dba0"])


def needle_grid(name: str) -> tuple[dict, float]:
    """{(length, depth): (correct, trials)} and the overall accuracy of one ``eval needle --json`` file."""
    with open(RESULTS / name, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    cells = {(r["length"], r["depth"]): (r["correct"], r["trials"]) for r in rows if "length" in r}
    total = next(r["accuracy"] for r in rows if "length" not in r)
    return cells, total


def plot_needle(out: Path) -> None:
    print("needle.png (BENCHMARKS: passkey retrieval)")
    grids = [(label, *needle_grid(name)) for label, name in NEEDLE_FILES]
    lengths = sorted({k[0] for _, cells, _ in grids for k in cells})
    depths = sorted({k[1] for _, cells, _ in grids for k in cells})
    fig, axes = plt.subplots(1, len(lengths), figsize=(11, 4.4), sharey=True, layout="constrained")
    for ax, length in zip(axes, lengths):
        frac = [[cells[length, d][0] / cells[length, d][1] for d in depths] for _, cells, _ in grids]
        ax.imshow(frac, cmap=NEEDLE_CMAP, vmin=0, vmax=1, aspect="auto")
        ax.set_xticks([j + 0.5 for j in range(len(depths) - 1)], minor=True)
        ax.set_yticks([i + 0.5 for i in range(len(grids) - 1)], minor=True)
        ax.grid(which="minor", color="white", lw=2)
        ax.tick_params(which="minor", length=0)
        for i, (_, cells, _) in enumerate(grids):
            for j, d in enumerate(depths):
                c, t = cells[length, d]
                ax.text(j, i, f"{c}/{t}", ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("passkey depth in the prompt")
        ax.set_title(f"{length:,}-token prompts", fontsize=10)
    axes[0].set_yticks(range(len(grids)), [f"{label} (all: {total:.0%})" for label, _, total in grids])
    for label, cells, total in grids:
        print(f"  {label}: " + "; ".join(" ".join(str(cells[n, d][0]) for d in depths) for n in lengths)
              + f"; {total:.0%}")
    fig.suptitle(f"Passkey retrieval by depth and length: {MODEL}, EPYC AVX-512 (pagedkv eval needle, "
                 "trials answered of 3 a cell)", fontsize=11)
    save(fig, out, "needle.png")


FIGURES = [plot_llama_cpp_batch, plot_ttft_rate, plot_sim_vs_real, plot_ppl_position, plot_needle]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the PNGs (default benchmarks/results)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for figure in FIGURES:
        figure(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
