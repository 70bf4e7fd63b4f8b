"""Text and plot of a simulated run (``pagedkv simulate``).

The text gives the settings, the cost model's source, throughput, the latency
percentiles (milliseconds), preemptions, KV use and waste, and how fast the simulator
ran. The plot (matplotlib, Agg) shows KV blocks in use and requests running and waiting
against simulated time.
"""

from __future__ import annotations

from pagedkv.sim.run import SimResult


def _corrections(eff: dict) -> str:
    """The calibration's measured corrections, briefly (none: empty)."""
    out = ""
    few = eff.get("few_row_factors") or ()
    if few:
        out += f", decodes of 1-{len(few)} requests x{min(few):.2f}-{max(few):.2f}"
    pre = [f for _, f in eff.get("prefill_factors") or ()]
    if pre:
        out += f", lone prefills x{min(pre):.2f}-{max(pre):.2f} ({len(pre)} lengths)"
    if eff.get("idle_wake_s"):
        out += f", +{1e3 * eff['idle_wake_s']:.2f} ms after idle"
    return out


def _ms(d: dict) -> str:
    if d.get("p50") is None:
        return "-"
    return " / ".join(f"{1e3 * d[k]:.1f}" for k in ("p50", "p90", "p99"))


def render(r: SimResult) -> str:
    s, m, w = r.settings, r.metrics, r.settings["workload"]
    eff = s["efficiency"]
    asked = s.get("request_rate")
    rate = "all at once" if w["last_arrival_s"] == 0 else (
        f"{w['num_requests'] / w['last_arrival_s']:.2f} req/s observed"
        + (f" (Poisson at {asked:g} asked)" if asked is not None else " (the trace's)"))
    lines = [
        f"simulated {s['model']} on {s['tp']} x {s['gpu_label']} ({s['weight_dtype']} weights, "
        f"{s['kv_cache_dtype']} KV, {s['num_blocks']} blocks of {s['block_size']} tokens, "
        f"max_model_len {s['max_model_len']}, {s['kv_allocator']} allocator)",
        f"cost model: {eff['source']}; memory x{eff['memory']:.3f}, compute x{eff['compute']:.3f}"
        + ("" if eff["kv_read"] is None else
           f", attention phase: KV reads x{eff['kv_read']:.3f}, FLOPs x{eff['attention']:.3f}")
        + f", +{1e3 * eff['step_overhead_s']:.2f} ms/step, +{1e3 * eff['request_overhead_s']:.3f} ms/request"
        + _corrections(eff),
        f"workload: {w['num_requests']} requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens, "
        f"arrivals {rate}",
        "",
        f"  duration              {m['duration_s']:.2f} s (simulated)",
        f"  throughput            {m['output_tokens_per_s']:.1f} output tok/s, {m['requests_per_s']:.3f} req/s",
        f"  TTFT p50/p90/p99      {_ms(m['ttft_s'])} ms",
        f"  TPOT p50/p90/p99      {_ms(m['tpot_s'])} ms",
        f"  ITL  p50/p90/p99      {_ms(m['itl_s'])} ms",
        f"  e2e  p50/p90/p99      {_ms(m['e2e_s'])} ms",
        f"  normalized latency    {_fmt_ms(m['normalized_latency_s'])} ms/token "
        "(mean over requests of e2e / output tokens)",
        f"  preemptions           {m['preemptions']}",
        f"  prefix cache hits     {m['prefix_hit_tokens']:,} tokens at admissions, readmissions after preemption "
        f"included ({w['prompt_tokens']:,} prompt tokens in the workload)",
        f"  KV blocks             peak {m['peak_kv_blocks']}, mean {m['mean_kv_blocks']:.1f} of {m['num_blocks']}; "
        f"waste {_pct(m['waste'])} (allocated slots holding no token)",
        f"  running at once       max {m['max_running']}, mean {m['mean_running']:.1f}; {m['steps']} steps",
        f"  simulator             {r.wall_s:.2f} s wall, {r.events_per_s:,.0f} events/s",
    ]
    off = m.get("kv_offload")
    if off:
        lines.insert(-1, f"  CPU KV tier           {off['hit_tokens']:,} prompt tokens loaded from it "
                         f"({off['blocks_loaded']:,} blocks, {off['load_seconds']:.2f} s over the host link), "
                         f"{off['blocks_saved']:,} blocks saved, {off['swap_outs']:,} swaps out")
        if "kv_offload_disk_size" in s:
            lines.insert(-1, f"  disk KV tier          {off['disk_hit_tokens']:,} prompt tokens loaded from it "
                             f"({off['disk_blocks_loaded']:,} blocks, {1e3 * s['disk_block_load_s']:.3f} ms each), "
                             f"{off['disk_blocks_written']:,} blocks written, {off['disk_blocks_used']:,} of "
                             f"{off['disk_capacity_blocks']:,} held at the end (NVMe rates: the simulated disk "
                             "starts empty)")
    sd = m.get("spec_decode")
    if sd and sd.get("acceptance_rate") is not None:
        lines.insert(-1, f"  speculative decoding  {sd['num_accepted_tokens']:,} of {sd['num_draft_tokens']:,} drafts "
                         f"accepted ({sd['acceptance_rate']:.1%}; asked {s['spec_acceptance_rate']:.1%}), "
                         f"{sd['mean_acceptance_length']:.2f} tokens per verification")
    return "\n".join(lines)


def _fmt_ms(v) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def plot_timeline(r: SimResult, path: str) -> None:
    """KV blocks in use (left axis) and requests running and waiting (right) over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = r.timeline
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(t["t_s"], t["kv_blocks_used"], color="tab:blue", label="KV blocks in use")
    ax.axhline(r.settings["num_blocks"], color="tab:blue", linestyle=":", label="KV blocks in the pool")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV blocks")
    ax2 = ax.twinx()
    ax2.plot(t["t_s"], t["running"], color="tab:green", label="running")
    ax2.plot(t["t_s"], t["waiting"], color="tab:red", label="waiting")
    ax2.set_ylabel("requests")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    s = r.settings
    ax.set_title(f"{s['model']} on {s['tp']} x {s['gpu']}: KV usage and queue (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
