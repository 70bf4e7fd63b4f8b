"""``plan()``: bytes per token, what fits, and how fast a step can possibly be.

Every KV figure comes from :class:`pagedkv.kv.spec.KVCacheSpec`, the class the
engine sizes its block pool with, so ``num_blocks`` here is the engine's
``num_blocks`` for the same budget. Capacity is per device of a ``tp``-way group:

    usable       = device memory × gpu_memory_utilization
    cache budget = usable − weight bytes / tp        (or --kv-cache-memory)
    num_blocks   = (budget − static scale bytes) // page bytes − 1 (the null page)
    max requests = (budget − static scale bytes) // paged bytes of one seq_len request

With a draft model (``speculative_config`` method ``draft_model``) the engine's pages hold
a block of both models' layers and its weights sit beside the target's, so the budget,
page bytes and request bytes above are both models' (:func:`pagedkv.kv.spec.pool_num_blocks`);
the speed lines stay the target's alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pagedkv.config.engine import parse_size
from pagedkv.kv.groups import reads_whole_tables
from pagedkv.kv.spec import SCALE_GRANULARITIES, KVCacheSpec, pool_cache_bytes, pool_num_blocks, pool_page_bytes
from pagedkv.model.config import ModelConfig
from pagedkv.planner import dtypes
from pagedkv.planner.hardware import Device, disk_block_load_seconds, get_device, nvme_read_bandwidth
from pagedkv.planner.models import load_model
from pagedkv.planner.notes import plan_notes
from pagedkv.planner.params import ParamCount, count_params
from pagedkv.planner.result import PlanResult, SweepRow
from pagedkv.planner.roofline import Roofline, sweep_batches

TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class _Inputs:
    """Resolved inputs of one plan: the model, device, dtypes and KV specs (per device and whole)."""
    m: ModelConfig
    dev: Device | None
    kv_dtype: str
    w_dtype: str
    spec: KVCacheSpec          # one device's share
    whole: KVCacheSpec         # the whole model (tp = 1)
    params: ParamCount
    weight_bytes: int
    tp: int
    seq_len: int
    batch: int
    util: float
    scale: str
    budget: int | None         # --kv-cache-memory in bytes, or None
    draft: ModelConfig | None = None   # the draft model of draft_model speculation
    draft_weight_bytes: int = 0
    reserved: int = 0          # --activation-peak: bytes beside the weights a profiled step takes

    def specs(self, tp: int | None = None) -> tuple[KVCacheSpec, ...]:
        """The per-device KV specs sharing one pool (target, then draft) at ``tp`` (default: the plan's)."""
        if tp is None or tp == self.tp:
            own = self.spec
        else:
            own = whole_pages(self.m.kv_spec(self.kv_dtype, self.spec.block_size, tp, self.scale),
                              not self.spec.page_windows)
        if self.draft is None:
            return (own,)
        return own, whole_pages(self.draft.kv_spec(self.kv_dtype, self.spec.block_size, tp or self.tp, self.scale))

    @property
    def all_weight_bytes(self) -> int:
        return self.weight_bytes + self.draft_weight_bytes


def whole_pages(spec: KVCacheSpec, whole: bool = True) -> KVCacheSpec:
    """``spec`` with every layer in every page, each holding every token, where the engine
    keeps one full-attention KV group (a draft model, the offload tiers: they read whole
    tables), else as it is (Gemma 2/3's hybrid pages, windows giving pages back)."""
    return replace(spec, page_layers=0, page_windows=False) if whole else spec


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _budget_blocks(specs: tuple[KVCacheSpec, ...], budget: int) -> int:
    """Blocks the engine would allocate for ``budget`` bytes; 0 where not even one fits."""
    try:
        return pool_num_blocks(specs, budget)
    except ValueError:
        return 0


def _requests_fitting(specs: tuple[KVCacheSpec, ...], budget: int, seq_len: int) -> int:
    static = sum(s.static_bytes for s in specs)
    return max(0, (budget - static) // sum(s.paged_bytes_for_tokens(seq_len) for s in specs))


def _min_tp(c: _Inputs, need: int) -> int | None:
    """Smallest TP degree where ``need`` requests (0: just the weights and one block) fit per
    device: in what the weights leave of it, or in ``--kv-cache-memory`` per device when given."""
    for tp in TP_CANDIDATES:
        try:
            specs = c.specs(tp)
        except ValueError:
            continue  # this degree does not split the KV heads
        budget = (c.budget if c.budget is not None
                  else int(c.dev.memory_bytes * c.util) - math.ceil(c.all_weight_bytes / tp) - c.reserved)
        if (_requests_fitting(specs, budget, c.seq_len) >= need) if need else _budget_blocks(specs, budget) >= 1:
            return tp
    return None


def _model_fields(c: _Inputs) -> dict:
    m, spec, whole, dev = c.m, c.spec, c.whole, c.dev
    exact, paged = whole.bytes_for_tokens(c.seq_len), whole.paged_bytes_for_tokens(c.seq_len)
    windows = [w for w in m.layer_windows if w is not None]
    return dict(
        model=m.name, model_source=m.source, gpu=dev.name if dev else None, gpu_label=dev.label if dev else None,
        gpu_source=dev.source if dev else None, tp=c.tp, seq_len=c.seq_len, batch=c.batch,
        kv_cache_dtype=c.kv_dtype, weight_dtype=c.w_dtype, kv_scale_granularity=c.scale,
        block_size=spec.block_size, gpu_memory_utilization=c.util, attention=m.attention,
        num_layers=m.num_hidden_layers, num_heads=m.num_attention_heads,
        num_kv_heads=1 if m.mla else m.num_key_value_heads,
        kv_heads_per_device=spec.num_kv_heads, head_dim=spec.head_dim, sliding_window_layers=len(windows),
        sliding_window=max(windows) if windows else None, max_position_embeddings=m.max_position_embeddings,
        bytes_per_token=whole.bytes_per_token, bytes_per_token_per_device=spec.bytes_per_token,
        bytes_per_request=exact, paged_bytes_per_request=paged, batch_bytes=exact * c.batch,
        paged_batch_bytes=paged * c.batch, paged_bytes_per_request_per_device=spec.paged_bytes_for_tokens(c.seq_len),
        num_params=c.params.total, active_params=c.params.active, weight_bytes=c.weight_bytes,
        weight_bytes_per_device=math.ceil(c.weight_bytes / c.tp), windows_free_pages=c.spec.page_windows,
        **_draft_fields(c))


def _draft_fields(c: _Inputs) -> dict:
    if c.draft is None:
        return {}
    return dict(draft_model=c.draft.name, draft_bytes_per_token=c.draft.kv_spec(c.kv_dtype, c.spec.block_size, 1,
                                                                                 c.scale).bytes_per_token,
                draft_weight_bytes=c.draft_weight_bytes)


def _capacity(c: _Inputs) -> dict:
    if c.dev is None and c.budget is None:
        return {}
    usable = int(c.dev.memory_bytes * c.util) if c.dev else None
    weights_dev = math.ceil(c.all_weight_bytes / c.tp)
    budget = c.budget if c.budget is not None else usable - weights_dev - c.reserved
    max_req = _requests_fitting(c.specs(), budget, c.seq_len) if budget > 0 else 0
    blocks = _budget_blocks(c.specs(), budget)
    out = dict(cache_budget_bytes=budget, num_blocks=blocks,
               max_cached_tokens=(blocks * c.spec.block_size * (c.spec.page_layers or c.spec.num_layers)
                                  // c.spec.num_layers),
               max_concurrent_requests=max_req, batch_fits=max_req >= c.batch)
    if c.dev:
        out.update(device_memory_bytes=c.dev.memory_bytes, usable_memory_bytes=usable, activation_peak_bytes=c.reserved,
                   weights_fit=usable - weights_dev >= pool_cache_bytes(c.specs(), 1),
                   min_tp_for_weights=_min_tp(c, 0), min_tp_for_batch=_min_tp(c, c.batch))
    return out


def _speed(c: _Inputs, max_req: int | None) -> dict:
    rf = Roofline(c.m, c.spec, c.dev, c.w_dtype, c.tp)
    rows = tuple(SweepRow(b, s.seconds, s.tokens_per_s, s.limited_by, None if max_req is None else b <= max_req)
                 for b, s in rf.sweep(c.seq_len, sweep_batches(c.batch, max_req)))
    per_dev = c.spec.paged_bytes_for_tokens(c.seq_len)
    return dict(decode=rf.decode(c.batch, c.seq_len), prefill=rf.prefill(c.seq_len), batch_sweep=rows,
                ridge_batch=rf.ridge_batch(c.seq_len),
                kv_equals_weights_batch=rf.weight_bytes_read(1) / c.spec.bytes_for_tokens(c.seq_len),
                kv_bound_tokens_per_s=rf.kv_bound_tokens_per_s(c.seq_len),
                host_link_seconds=per_dev / c.dev.host_link if c.dev.host_link else None,
                nvme_seconds=c.whole.paged_bytes_for_tokens(c.seq_len) / nvme_read_bandwidth())


def _tiers(c: _Inputs, memory, disk) -> dict:
    """The KV offload tiers' capacity (whole pages per device) and per-block load time."""
    from pagedkv.connectors.offload.disk_tier import RECORD_OVERHEAD

    page, out = pool_page_bytes(c.specs()), {}
    link = tier_link(c.dev, c.specs(), page) if c.dev is not None and (memory is not None or disk is not None) else None
    if memory is not None:
        n = parse_size(memory, "kv_offload_memory (--kv-offload-memory)") // page
        out.update(offload_cpu_blocks=n, offload_cpu_tokens=n * c.spec.block_size,
                   offload_cpu_block_load_seconds=page / link if link else None)
    if disk is not None:
        n = parse_size(disk, "kv_offload_disk_size (--kv-offload-disk-size)") // (page + RECORD_OVERHEAD)
        out.update(offload_disk_blocks=n, offload_disk_tokens=n * c.spec.block_size,
                   offload_disk_block_load_seconds=disk_block_load_seconds(page, link) if c.dev else None)
    return out


def tier_link(dev: Device, specs, page: int) -> float | None:
    """Bytes/s of moving one page between the device cache and host memory: the host link
    (PCIe one way) on a GPU; on the CPU, a page copy piece by piece (a K or V piece per
    layer) at the rate measured for pieces of that size
    (:func:`~pagedkv.planner.cpu.page_copy_bandwidth`). The planner and the simulator
    price CPU-tier copies and the last leg of a disk load with it."""
    if not dev.is_cpu:
        return dev.host_link
    from pagedkv.planner.cpu import page_copy_bandwidth

    pieces = sum(s.num_layers * (1 if s.mla_latent_dim else 2) for s in specs)  # K and V of every layer
    return page_copy_bandwidth(max(1, page // pieces))


def _preemption(c: _Inputs, f: dict) -> dict:
    """A ``seq_len``-token request's swap round trip (out and back over the host link, or
    through the CPU tier at the measured page copy rate) beside its recompute (the prefill
    bound): what ``--preemption-mode auto`` weighs per victim."""
    if f.get("prefill") is None:
        return {}
    recompute = {"preempt_recompute_seconds": f["prefill"].seconds}
    if f.get("host_link_seconds"):
        return {"preempt_swap_seconds": 2 * f["host_link_seconds"]} | recompute
    if f.get("offload_cpu_block_load_seconds"):
        blocks = math.ceil(c.seq_len / c.spec.block_size)
        return {"preempt_swap_seconds": 2 * blocks * f["offload_cpu_block_load_seconds"]} | recompute
    return {}


def _resolve(model, gpu, kv_cache_dtype, weight_dtype, seq_len, batch, tp, util, kv_heads, block_size,
             kv_cache_memory, scale, speculative_config=None) -> _Inputs:
    for name, v in (("seq_len", seq_len), ("batch", batch), ("tp", tp), ("block_size", block_size)):
        _check_int(name, v)
    if not 0 < float(util) <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    if scale not in SCALE_GRANULARITIES:
        raise ValueError(f"kv scale granularity must be one of {', '.join(SCALE_GRANULARITIES)}")
    budget = parse_size(kv_cache_memory, "kv_cache_memory (--kv-cache-memory)") if kv_cache_memory is not None else None
    m = load_model(model).with_kv_heads(None if kv_heads is None else _check_int("kv_heads", kv_heads))
    dev = get_device(gpu) if gpu else None
    on_gpu = dev is not None and not dev.is_cpu
    kv_dtype = dtypes.resolve_kv(kv_cache_dtype, m.torch_dtype, on_gpu)
    w_dtype = dtypes.resolve_weights(weight_dtype, m.torch_dtype, on_gpu, m.quant_method)
    params = count_params(m)
    draft = _draft_model(speculative_config)
    draft_weights = 0 if draft is None else math.ceil(count_params(draft).total * dtypes.WEIGHT_DTYPE_BYTES[
        dtypes.resolve_weights(weight_dtype, draft.torch_dtype, on_gpu, draft.quant_method)])
    return _Inputs(m, dev, kv_dtype, w_dtype, m.kv_spec(kv_dtype, block_size, tp, scale),
                   m.kv_spec(kv_dtype, block_size, 1, scale), params,
                   math.ceil(params.total * dtypes.WEIGHT_DTYPE_BYTES[w_dtype]), tp, seq_len, batch,
                   float(util), scale, budget, draft, draft_weights)


def _draft_model(speculative_config) -> ModelConfig | None:
    """The draft's config for a ``draft_model`` speculative config (a bundled name or a
    config.json path, as ``--model``), else None."""
    from pagedkv.config.speculative import SpeculativeConfig

    sc = SpeculativeConfig.parse(speculative_config)
    return load_model(sc.model) if sc is not None and sc.method == "draft_model" else None


def plan(model: str = "smollm2-135m-instruct", gpu: str | None = None, kv_cache_dtype: str = "auto",
         weight_dtype: str = "auto", seq_len: int = 4096, batch: int = 1, tp: int = 1,
         gpu_memory_utilization: float = 0.9, kv_heads: int | None = None, block_size: int = 16,
         kv_cache_memory: int | str | None = None, kv_scale_granularity: str = "per-token-head",
         kv_offload_memory: int | str | None = None, kv_offload_disk_size: int | str | None = None,
         speculative_config: dict | str | None = None, activation_peak: int | str | None = None) -> PlanResult:
    """Plan ``batch`` requests of ``seq_len`` tokens of ``model`` on ``tp`` × ``gpu``.

    Args:
        model: bundled name (``--list-models``) or path to a config.json / its folder.
        gpu: catalog name (``--list-gpus``), ``"cpu"`` (measured), or ``None`` (memory arithmetic only).
        kv_cache_dtype, weight_dtype: dtype names or ``"auto"`` (see :mod:`pagedkv.planner.dtypes`).
        seq_len: tokens per request (prompt + output); batch: concurrent requests; tp: tensor-parallel degree.
        gpu_memory_utilization: fraction of device memory for weights + cache (vLLM's meaning).
        kv_heads: override the KV head count (the MHA/GQA/MQA variant of the model).
        block_size: token slots per KV page.
        kv_cache_memory: cache budget per device (bytes or text such as ``"256MiB"``), replacing
            ``usable − weights``; ``num_blocks`` is then the engine's pool size for it.
        kv_scale_granularity: where quantized KV dtypes keep scales (see ``KVCacheSpec``).
        kv_offload_memory, kv_offload_disk_size: the engine's CPU and disk KV tiers (bytes or
            text), sized in blocks with their per-block load time.
        speculative_config: the engine's (dict or JSON text); a ``draft_model`` adds the
            draft's weights and its KV to every page, as the engine allocates them.
        activation_peak: bytes per device beside the weights that the engine's profiling step
            takes (its activation peak plus the memory torch does not manage, as the GPU
            engine logs them: :mod:`pagedkv.worker.memory`), subtracted from ``usable − weights``
            so that ``num_blocks`` is the GPU engine's.

    Raises:
        ValueError: on an unknown model, GPU or dtype, a malformed config.json, or a bad number.
    """
    c = _resolve(model, gpu, kv_cache_dtype, weight_dtype, seq_len, batch, tp, gpu_memory_utilization,
                 kv_heads, block_size, kv_cache_memory, kv_scale_granularity, speculative_config)
    if activation_peak is not None:
        zero = activation_peak in (0, "0")
        c = replace(c, reserved=0 if zero else parse_size(activation_peak, "activation_peak (--activation-peak)"))
    one_group = reads_whole_tables(c.draft is not None,
                                   kv_offload_memory is not None or kv_offload_disk_size is not None)
    c = replace(c, spec=whole_pages(c.spec, one_group), whole=whole_pages(c.whole, one_group))
    fields = {**_model_fields(c), **_capacity(c)}
    if c.dev:
        fields.update(_speed(c, fields.get("max_concurrent_requests")))
    fields.update(_tiers(c, kv_offload_memory, kv_offload_disk_size))
    fields.update(_preemption(c, fields))
    notes = plan_notes(PlanResult(**fields), c.m, c.dev, kv_cache_dtype, weight_dtype)
    return PlanResult(**fields, notes=tuple(notes))
