"""``--plot FILE.png``: three panels for one plan (matplotlib, Agg backend).

1. KV cache per device (GiB = 2^30 bytes, whole blocks) against context length,
   one line per batch size, with the device's memory, its usable part and what is
   left for the cache after weights as horizontal lines.
2. The decode-step lower bound against batch size (log-log): memory bound,
   compute bound and the larger of the two; the largest batch that fits marked.
3. Decode tokens/s bound against batch, with the memory-bus limit (bandwidth / KV
   bytes per sequence) it approaches and the first compute-bound batch, if any.
"""

from __future__ import annotations

from pagedkv.planner.hardware import get_device
from pagedkv.planner.models import bundled_names, load_model
from pagedkv.planner.result import PlanResult
from pagedkv.planner.roofline import Roofline

GIB = 2**30
DEFAULT_BATCHES = (1, 8, 32, 128)


def _model_and_spec(r: PlanResult):
    m = load_model(r.model if r.model in bundled_names() else r.model_source)
    if r.attention != "MLA":
        m = m.with_kv_heads(r.num_kv_heads)
    return m, m.kv_spec(r.kv_cache_dtype, r.block_size, r.tp, r.kv_scale_granularity)


def _contexts(r: PlanResult) -> list[int]:
    top = max(r.seq_len, r.max_position_embeddings or r.seq_len)
    out, c = [], 128
    while c < top:
        out.append(c)
        c *= 2
    return sorted(set(out + [top, r.seq_len]))


def _tokens_label(x, _pos=None) -> str:
    """Axis label for a token or batch count: 512, 4K, 128K, 1M."""
    for scale, suffix in ((2**20, "M"), (2**10, "K")):
        if x >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def _log2_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    ax.grid(True, which="both", alpha=0.3)


def _memory_panel(ax, r: PlanResult, spec, batches) -> None:
    ctx = _contexts(r)
    for b in batches:
        ax.plot(ctx, [b * spec.paged_bytes_for_tokens(c) / GIB for c in ctx], marker=".", label=f"batch {b}")
    if r.device_memory_bytes:
        ax.axhline(r.device_memory_bytes / GIB, color="black", lw=1.5, label="device memory")
        ax.axhline(r.usable_memory_bytes / GIB, color="gray", ls=":", lw=1.5,
                   label=f"usable ({r.gpu_memory_utilization:g} x memory)")
    if r.cache_budget_bytes and r.cache_budget_bytes > 0:
        ax.axhline(r.cache_budget_bytes / GIB, color="red", ls="--", lw=1.5, label="left for KV cache after weights")
    ax.axvline(r.seq_len, color="gray", ls="-.", lw=0.8)
    ax.set(yscale="log", xlabel="context length per request (tokens)", ylabel="KV cache per device (GiB)",
           title=f"KV cache vs context ({r.kv_cache_dtype}, whole blocks)")
    _log2_axis(ax)
    ax.legend(fontsize=8, loc="lower right")


def _fit_line(ax, r: PlanResult) -> None:
    if r.max_concurrent_requests:
        ax.axvline(r.max_concurrent_requests, color="red", ls="--", lw=1,
                   label=f"most requests that fit ({r.max_concurrent_requests:,})")


def _step_panel(ax, r: PlanResult, batches, steps) -> None:
    ax.plot(batches, [s.seconds * 1e3 for s in steps], color="0.8", lw=6, label="step lower bound (the larger)")
    ax.plot(batches, [s.memory_seconds * 1e3 for s in steps], "--", color="tab:blue", lw=2,
            label="memory: bytes read / bandwidth")
    ax.plot(batches, [s.compute_seconds * 1e3 for s in steps], ":", color="tab:orange", lw=2,
            label="compute: FLOPs / peak rate")
    _fit_line(ax, r)
    ax.set(yscale="log", xlabel="batch (concurrent sequences)", ylabel="decode step time (ms)",
           title=f"Decode step bound vs batch (context {r.seq_len:,})")
    _log2_axis(ax)
    ax.legend(fontsize=8, loc="upper left")


def _rate_panel(ax, r: PlanResult, batches, steps) -> None:
    ax.plot(batches, [s.tokens_per_s for s in steps], color="tab:green", lw=2, marker=".",
            label="decode tokens/s bound")
    ax.axhline(r.kv_bound_tokens_per_s, color="tab:blue", ls="--", lw=1.5,
               label=f"memory-bus limit: bandwidth / KV per sequence ({r.kv_bound_tokens_per_s:,.0f})")
    if r.ridge_batch:
        ax.axvline(r.ridge_batch, color="tab:orange", ls=":", lw=1.5,
                   label=f"compute-bound from batch {r.ridge_batch:,}")
    _fit_line(ax, r)
    ax.set(yscale="log", xlabel="batch (concurrent sequences)", ylabel="tokens/s (all sequences)",
           title=f"Decode throughput bound vs batch (context {r.seq_len:,})")
    _log2_axis(ax)
    ax.legend(fontsize=8, loc="lower right")


def plot_plan(r: PlanResult, path: str, batches: list[int] | None = None) -> None:
    """Write the three-panel PNG for ``r`` to ``path``.

    Raises:
        ValueError: if ``r`` has no device (``--plot`` needs ``--gpu``).
    """
    if r.gpu is None:
        raise ValueError("--plot needs --gpu (the plot compares the cache with the device)")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m, spec = _model_and_spec(r)
    rf = Roofline(m, spec, get_device(r.gpu), r.weight_dtype, r.tp)
    sweep = [2**i for i in range(13)]
    steps = [rf.decode(b, r.seq_len) for b in sweep]
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.8), constrained_layout=True)
    _memory_panel(axes[0], r, spec, sorted(set(batches or DEFAULT_BATCHES) | {r.batch}))
    _step_panel(axes[1], r, sweep, steps)
    _rate_panel(axes[2], r, sweep, steps)
    fig.suptitle(f"{r.model} on {r.tp} x {r.gpu_label}: KV {r.kv_cache_dtype}, weights {r.weight_dtype}",
                 fontsize=13)
    fig.savefig(path, dpi=110)
    plt.close(fig)
