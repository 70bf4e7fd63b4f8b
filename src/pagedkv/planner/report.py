"""Human-readable text of a :class:`PlanResult` (what ``pagedkv plan`` prints without ``--json``).

Sizes print as exact bytes plus decimal and binary units (GB = 1e9, GiB = 2^30).
"""

from __future__ import annotations

from pagedkv.kv.spec import QUANTIZED_DTYPES
from pagedkv.planner.hardware import get_device, nvme_read_bandwidth
from pagedkv.planner.result import PlanResult
from pagedkv.planner.units import fmt_bytes, fmt_flop_count, fmt_flops, fmt_rate, fmt_seconds, fmt_short

W = 30  # label column width


def _row(label: str, value: str) -> str:
    return f"  {label:<{W}}{value}"


def _header(r: PlanResult) -> list[str]:
    where = f" on {r.tp} x {r.gpu_label}" if r.gpu and r.tp > 1 else f" on {r.gpu_label}" if r.gpu else ""
    kv = f"{r.num_kv_heads} KV heads ({r.attention})" if r.attention != "MLA" else \
        f"MLA latent of {r.head_dim} per layer and token"
    lines = [f"pagedkv plan: {r.model}{where}" + (f" (tp={r.tp})" if r.tp > 1 else ""),
             _row("model", f"{r.num_layers} layers, {r.num_heads} query heads, {kv}"
                  + ("" if r.attention == "MLA" else f", head_dim {r.head_dim}")),
             _row("", f"source: {r.model_source}")]
    if r.gpu:
        lines += [_row("device", _device_line(r)), _row("", f"source: {r.gpu_source}")]
    scales = f" (scales {r.kv_scale_granularity})" if r.kv_cache_dtype in QUANTIZED_DTYPES else ""
    lines.append(_row("dtypes", f"kv cache {r.kv_cache_dtype}{scales}, weights {r.weight_dtype}; "
                      f"block_size {r.block_size}"))
    return lines


def _device_line(r: PlanResult) -> str:
    d = get_device(r.gpu)
    link = f", PCIe Gen{d.pcie_gen} x16 ({fmt_rate(d.host_link)} one way)" if d.host_link else ""
    nv = f", GPU link {d.nvlink / 1e9:,.0f} GB/s" if d.nvlink else ""
    return (f"{fmt_short(d.memory_bytes)}, {fmt_rate(d.bandwidth)}, "
            f"{fmt_flops(d.flops_16)} {'fp32 (measured)' if d.is_cpu else 'fp16 dense'}{link}{nv}")


def _kv(r: PlanResult) -> list[str]:
    lines = ["", "KV cache",
             _row("bytes per token", f"{r.bytes_per_token:,} B (all {r.num_layers} layers)"),
             _row(f"per request ({r.seq_len:,} tokens)", fmt_bytes(r.bytes_per_request))]
    if r.paged_bytes_per_request != r.bytes_per_request:
        lines.append(_row("  in whole blocks (paged)", fmt_bytes(r.paged_bytes_per_request)))
    lines.append(_row(f"batch of {r.batch:,}", fmt_bytes(r.batch_bytes)))
    if r.tp > 1:
        share = "the whole latent on each device" if r.attention == "MLA" else \
            f"{r.kv_heads_per_device} of {r.num_kv_heads} KV heads on " + \
            ("each device" if r.num_kv_heads % r.tp == 0 or r.tp > r.num_kv_heads else "the most loaded device")
        lines.append(_row("per device, per token", f"{r.bytes_per_token_per_device:,} B ({share})"))
    if r.draft_model is not None:
        lines.append(_row("draft model's, per token", f"{r.draft_bytes_per_token:,} B ({r.draft_model}; "
                          "in the same pages: capacity counts both)"))
    return lines


def _weights(r: PlanResult) -> list[str]:
    active = f" ({r.active_params:,} active per token)" if r.active_params != r.num_params else ""
    lines = ["", "Weights", _row("parameters", f"{r.num_params:,}{active}"),
             _row(f"bytes ({r.weight_dtype})", fmt_bytes(r.weight_bytes))]
    if r.tp > 1:
        lines.append(_row("per device", fmt_bytes(r.weight_bytes_per_device)))
    if r.draft_weight_bytes is not None:
        lines.append(_row("draft model", f"{fmt_bytes(r.draft_weight_bytes)} more"))
    return lines


def _capacity(r: PlanResult) -> list[str]:
    if r.cache_budget_bytes is None:
        return []
    lines = ["", "Capacity (per device)"]
    if r.device_memory_bytes is not None:
        lines += [_row("device memory", fmt_bytes(r.device_memory_bytes)),
                  _row(f"usable (x {r.gpu_memory_utilization:.2f})", fmt_bytes(r.usable_memory_bytes)),
                  _row("weights fit", "yes" if r.weights_fit else "NO")]
        if r.activation_peak_bytes:  # --activation-peak: the engine's profiled step, taken off the budget too
            lines.append(_row("activation peak (given)", fmt_bytes(r.activation_peak_bytes)))
    lines += [_row("KV cache budget", fmt_bytes(max(r.cache_budget_bytes, 0))),
              _row(f"blocks of {r.block_size} tokens", f"{r.num_blocks:,} ({r.max_cached_tokens:,} tokens"
                   + (" if every layer kept every token; a block holds one KV group's layers, window and "
                      "full layers in separate blocks, and window layers give theirs back)"
                      if r.max_cached_tokens < r.num_blocks * r.block_size else ")")),
              _row(f"requests of {r.seq_len:,} tokens", f"{r.max_concurrent_requests:,} fit; batch of "
                   f"{r.batch:,} {'fits' if r.batch_fits else 'does NOT fit'}")]
    return lines


def _speed(r: PlanResult) -> list[str]:
    if r.decode is None:
        return []
    d, p = r.decode, r.prefill
    return ["", f"Decode step lower bound (batch {r.batch:,}, context {r.seq_len:,}, per device)",
            _row("memory", f"{fmt_seconds(d.memory_seconds)}  ({fmt_short(d.bytes_read)} read)"),
            _row("compute", f"{fmt_seconds(d.compute_seconds)}  ({fmt_flop_count(d.flops)})"),
            *([_row("all-reduce", f"{fmt_seconds(d.allreduce_seconds)}  (2 per layer over the GPU link, "
                    "added: not overlapped)")] if d.allreduce_seconds else []),
            _row("bound", f"{fmt_seconds(d.seconds)}, {d.limited_by}-bound: at most "
                 f"{d.tokens_per_s:,.0f} tokens/s"),
            "", f"Prefill lower bound (one {r.seq_len:,}-token prompt)",
            _row("bound", f"{fmt_seconds(p.seconds)}, {p.limited_by}-bound ({fmt_flop_count(p.flops)} "
                 f"per device; memory {fmt_seconds(p.memory_seconds)}"
                 + (f"; all-reduce {fmt_seconds(p.allreduce_seconds)})" if p.allreduce_seconds else ")"))]


def _sweep(r: PlanResult) -> list[str]:
    if not r.batch_sweep:
        return []
    lines = ["", f"Decode tokens/s bound vs batch (context {r.seq_len:,})",
             f"  {'batch':>7} {'step':>10} {'tokens/s':>12}  {'bound':<8} fits"]
    for row in r.batch_sweep:
        fits = "" if row.fits is None else "yes" if row.fits else "no"
        lines.append(f"  {row.batch:>7,} {fmt_seconds(row.step_seconds):>10} {row.tokens_per_s:>12,.0f}  "
                     f"{row.limited_by:<8} {fits}")
    ridge = (f"compute-bound from batch {r.ridge_batch:,}" if r.ridge_batch else
             "memory-bound at every batch (each sequence's KV reads outweigh its FLOPs)")
    lines += [f"  KV reads equal weight reads at batch {r.kv_equals_weights_batch:,.0f}; {ridge};",
              f"  the memory bus caps decode at {r.kv_bound_tokens_per_s:,.0f} tokens/s as batch grows"]
    return lines


def _transfer(r: PlanResult) -> list[str]:
    if r.decode is None:
        return []
    d = get_device(r.gpu)
    lines = ["", f"Moving one request's cache ({fmt_short(r.paged_bytes_per_request_per_device)} per device)"]
    if d.host_link:
        lines.append(_row(f"over PCIe Gen{d.pcie_gen} x16", f"{fmt_seconds(r.host_link_seconds)} at "
                          f"{fmt_rate(d.host_link)} one way ({d.bandwidth / d.host_link:,.1f}x slower than "
                          f"device memory)"))
    lines.append(_row("from NVMe (whole request)", f"{fmt_seconds(r.nvme_seconds)} at "
                      f"{fmt_rate(nvme_read_bandwidth())}"))
    if r.preempt_swap_seconds is not None:
        pick = "swap" if r.preempt_swap_seconds <= r.preempt_recompute_seconds else "recompute"
        lines.append(_row("preempting it", f"swap out and back {fmt_seconds(r.preempt_swap_seconds)}, recompute "
                          f"{fmt_seconds(r.preempt_recompute_seconds)} (prefill bound): {pick} is cheaper "
                          f"(what --preemption-mode auto weighs)"))
    return lines


def _tiers(r: PlanResult) -> list[str]:
    if r.offload_cpu_blocks is None and r.offload_disk_blocks is None:
        return []
    lines = ["", "KV offload tiers (per device; a block is one page of every layer)"]
    for tier, blocks, tokens, secs, how in (
            ("CPU tier", r.offload_cpu_blocks, r.offload_cpu_tokens, r.offload_cpu_block_load_seconds,
             "over the host link" if r.gpu != "cpu" else "at the page copy rate measured here"),
            ("disk tier", r.offload_disk_blocks, r.offload_disk_tokens, r.offload_disk_block_load_seconds,
             f"NVMe read at {fmt_rate(nvme_read_bandwidth())}" + (", then the host link" if r.gpu != "cpu" else ""))):
        if blocks is None:
            continue
        load = f"; load {fmt_seconds(secs)} per block {how}" if secs is not None else ""
        lines.append(_row(tier, f"{blocks:,} blocks = {tokens:,} tokens{load}"))
    return lines


def render(r: PlanResult) -> str:
    """The full text report."""
    lines = (_header(r) + _kv(r) + _weights(r) + _capacity(r) + _speed(r) + _sweep(r) + _transfer(r)
             + _tiers(r))
    if r.notes:
        lines += ["", "Notes"] + [f"  - {n}" for n in r.notes]
    return "\n".join(lines)
