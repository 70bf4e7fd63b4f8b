"""Plain-language findings for a plan: what does not fit and what to change, how ``auto``
resolved, and the modelling choices a reader should know (replicated KV heads, window
caps, FP8 on parts without FP8 units)."""

from __future__ import annotations

from pagedkv.model.config import ModelConfig, head_spans
from pagedkv.planner.hardware import Device
from pagedkv.planner.units import fmt_bytes


def _dtype_notes(r, dev: Device | None, kv_arg: str, w_arg: str) -> list[str]:
    out = []
    gpu = dev and not dev.is_cpu
    cpu = "the engine computes in float32 on CPU; pass --gpu NAME or a dtype"
    kv_where = "on a GPU, the model's activation dtype" if gpu else cpu
    w_where = "on a GPU, the checkpoint's own dtype" if gpu else cpu
    if str(kv_arg).lower() == "auto":
        out.append(f"kv cache dtype auto -> {r.kv_cache_dtype} ({kv_where})")
    if str(w_arg).lower() == "auto":
        out.append(f"weight dtype auto -> {r.weight_dtype} ({w_where}; the CPU engine's --weight-dtype auto "
                   "keeps a GGUF's Q4_1/Q8_0 blocks instead: plan them with --weight-dtype q4_1 or q8_0)")
    if dev and r.weight_dtype.startswith("fp8") and not dev.flops_fp8:
        out.append(f"{dev.label} has no FP8 matrix units: FP8 weights save memory and bandwidth, "
                   "but the compute bound uses its 16-bit rate")
    return out


def _layout_notes(r, m: ModelConfig) -> list[str]:
    out = []
    if m.max_position_embeddings and r.seq_len > m.max_position_embeddings:
        out.append(f"seq_len {r.seq_len:,} exceeds the model's max_position_embeddings "
                   f"{m.max_position_embeddings:,}")
    if r.sliding_window_layers:
        blocks = (f"{fmt_bytes(r.paged_bytes_per_request)} in whole {r.block_size}-token blocks (a window "
                  "that does not start on a block edge straddles one more)"
                  if r.paged_bytes_per_request != r.bytes_per_request
                  else f"the same in whole {r.block_size}-token blocks")
        if not r.windows_free_pages:
            blocks = (f"but the engine holds {fmt_bytes(r.paged_bytes_per_request)} in whole {r.block_size}-token "
                      "blocks: with offload tiers or a draft model (or several windows) it keeps one KV group, "
                      "whose pages every layer holds for every token")
        out.append(f"{r.sliding_window_layers} of {r.num_layers} layers slide over {r.sliding_window:,} tokens: "
                   f"a request of {r.seq_len:,} tokens holds {fmt_bytes(r.bytes_per_request)} exactly, {blocks}")
    if m.mla and r.tp > 1:
        out.append("MLA's latent cache is not split by head: every TP device holds all of it")
    elif not m.mla and r.tp > m.num_key_value_heads:
        out.append(f"--tp {r.tp} exceeds the {m.num_key_value_heads} KV heads: each device holds 1 head, "
                   f"so the cache is replicated {r.tp // m.num_key_value_heads}x across the group")
    elif not m.mla and m.num_key_value_heads % r.tp:
        shares = ", ".join(str(b - a) for _, (a, b) in head_spans(m.num_attention_heads, m.num_key_value_heads, r.tp))
        out.append(f"--tp {r.tp} splits the {m.num_key_value_heads} KV heads unevenly ({shares} per device; pagedkv's "
                   "engine does, vLLM and SGLang do not): the per-device figures are the most loaded device's")
    if m.attention in ("GQA", "MQA"):
        mha = r.bytes_per_token * m.num_attention_heads // m.num_key_value_heads
        out.append(f"with MHA (--kv-heads {m.num_attention_heads}) it would take {mha:,} B/token, "
                   f"{m.num_attention_heads // m.num_key_value_heads}x this {m.attention} cache")
    return out


def _batch_note(r) -> str:
    """What of the batch fits in the cache, and what would make all of it fit."""
    one, need = r.batch == 1, fmt_bytes(r.paged_bytes_per_request_per_device * r.batch)
    if (r.min_tp_for_batch or 0) > r.tp:
        hint = f"{'it fits' if one else f'all {r.batch:,} fit'} with --tp {r.min_tp_for_batch}"
    else:
        hint = f"{'it needs' if one else 'they need'} a cache of about {need} per device at --tp {r.tp}" + (
            "" if r.min_tp_for_batch or r.gpu is None else f"; no --tp up to 64 fits {'it' if one else 'them all'}")
    if one:
        return f"the request of {r.seq_len:,} tokens does not fit in the cache; {hint}"
    some = "none" if r.max_concurrent_requests == 0 else f"only {r.max_concurrent_requests:,}"
    return f"{some} of the {r.batch:,} requests of {r.seq_len:,} tokens fit in the cache; {hint}"


def _fit_notes(r) -> list[str]:
    out = []
    if r.weights_fit is False:
        per = fmt_bytes(r.weight_bytes_per_device)
        usable = fmt_bytes(r.usable_memory_bytes)
        hint = f"fits with --tp {r.min_tp_for_weights}" if r.min_tp_for_weights else "does not fit at --tp 64"
        out.append(f"weights do not fit: {per} per device > {usable} usable; {hint}")
    elif r.batch_fits is False and r.max_concurrent_requests is not None:
        out.append(_batch_note(r))
    if r.num_blocks == 0 and r.weights_fit is not False:  # (weights that do not fit: the note above says why)
        out.append("the cache budget holds no KV block beside the reserved null page: the engine refuses it "
                   "(raise --kv-cache-memory, or --tp or --gpu-memory-utilization)")
    if r.cache_budget_bytes is not None and r.usable_memory_bytes is not None and \
            r.cache_budget_bytes + r.weight_bytes_per_device > r.usable_memory_bytes:
        out.append("--kv-cache-memory plus the weights exceed the usable device memory")
    return out


def plan_notes(r, m: ModelConfig, dev: Device | None, kv_arg: str, w_arg: str) -> list[str]:
    """Findings for :class:`PlanResult` ``r``; ``kv_arg``/``w_arg`` are the dtypes as the user gave them."""
    out = _dtype_notes(r, dev, kv_arg, w_arg) + _layout_notes(r, m) + _fit_notes(r)
    if dev is None:
        out.append("no --gpu: pass --gpu NAME (see --list-gpus) or --gpu cpu for capacity and speed bounds")
    return out
