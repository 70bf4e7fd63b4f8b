"""PlanResult: the typed answer of :func:`pagedkv.planner.plan`; ``to_dict()`` is the ``--json`` output.

All sizes are bytes (ints); times are seconds; rates are per second. "Per device"
means one of the ``tp`` devices of a tensor-parallel group. Fields that need a
device are ``None`` without ``--gpu``; capacity fields are also set when only
``--kv-cache-memory`` is given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.planner.roofline import StepBound


@dataclass(frozen=True)
class SweepRow:
    """Decode bound at one batch size: ``fits`` says whether that many ``seq_len`` requests fit."""
    batch: int
    step_seconds: float
    tokens_per_s: float
    limited_by: str
    fits: bool | None


@dataclass(frozen=True)
class PlanResult:
    """Everything ``pagedkv plan`` reports.

    Inputs (resolved): ``model``, ``model_source``, ``gpu``, ``gpu_label``, ``gpu_source``, ``tp``,
    ``seq_len``, ``batch``, ``kv_cache_dtype``, ``weight_dtype``, ``kv_scale_granularity``,
    ``block_size``, ``gpu_memory_utilization``.

    Model: ``attention`` (MHA/GQA/MQA/MLA), ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``kv_heads_per_device``, ``head_dim``, ``sliding_window_layers``, ``sliding_window``
    (tokens, the largest window), ``max_position_embeddings``.

    KV cache (bytes): ``bytes_per_token`` (whole model, all layers, no window cap),
    ``bytes_per_token_per_device``, ``bytes_per_request`` (one ``seq_len`` request, windows
    capped, exact), ``paged_bytes_per_request`` (the same, rounded up to whole blocks per layer,
    as a paged engine holds it), ``batch_bytes`` and ``paged_batch_bytes`` (times ``batch``),
    ``paged_bytes_per_request_per_device`` (one device's share of a request),
    ``windows_free_pages`` (window layers give pages back; False where the engine keeps one
    KV group, with offload tiers or a draft model: the paged figures then hold every block).

    Weights: ``num_params``, ``active_params`` (per token; MoE), ``weight_bytes``,
    ``weight_bytes_per_device``.

    Capacity (per device): ``device_memory_bytes``, ``usable_memory_bytes``
    (× gpu_memory_utilization), ``activation_peak_bytes`` (``--activation-peak``, 0 if
    not given), ``cache_budget_bytes`` (usable − weights − activation peak, or
    ``--kv-cache-memory``), ``num_blocks`` (the engine's pool for that budget:
    ``KVCacheSpec.num_blocks_for``), ``max_cached_tokens`` (tokens of every layer those
    blocks hold: num_blocks × block_size, times layers per block / layers where a block holds
    one KV group's layers),
    ``max_concurrent_requests`` (of ``seq_len`` tokens), ``weights_fit``, ``batch_fits``,
    ``min_tp_for_weights``, ``min_tp_for_batch``.

    Speed (lower bounds, per device): ``decode`` and ``prefill`` (:class:`StepBound`),
    ``batch_sweep`` (:class:`SweepRow` list), ``ridge_batch`` (first compute-bound batch, or
    ``None``), ``kv_equals_weights_batch`` (batch where KV reads equal weight reads),
    ``kv_bound_tokens_per_s`` (limit of decode tokens/s as batch grows), ``host_link_seconds``
    and ``nvme_seconds`` (moving one request's paged cache over the host link / from NVMe).

    KV offload tiers (with ``kv_offload_memory`` / ``kv_offload_disk_size``, per device):
    ``offload_cpu_blocks`` / ``_tokens`` and ``offload_disk_blocks`` / ``_tokens`` (what
    the engine's tiers hold: whole pages; a disk record also budgets 8 KiB of header), and
    the time to load one block into the cache, ``offload_cpu_block_load_seconds`` (over
    PCIe on a GPU; on ``cpu`` at this machine's rate of copying page-sized pieces, measured
    at the model's piece size: :func:`pagedkv.planner.cpu.page_copy_bandwidth`) and
    ``offload_disk_block_load_seconds`` (NVMe read, then the host link on a GPU).
    ``preempt_swap_seconds``: one request's swap preemption round trip (its pages out and
    back over the host link on a GPU, or through the CPU tier at the measured page copy
    rate on ``cpu`` with ``kv_offload_memory``), beside ``preempt_recompute_seconds``
    (recomputing it: the prefill bound), as ``--preemption-mode auto`` weighs them.

    Draft model (with a ``draft_model`` speculative config): ``draft_model``,
    ``draft_bytes_per_token`` (its KV per token, whole model) and ``draft_weight_bytes``; the
    capacity fields then count both models' weights and KV, as the engine's pool does.

    ``notes``: plain-language findings and caveats.
    """
    model: str
    model_source: str
    gpu: str | None
    gpu_label: str | None
    gpu_source: str | None
    tp: int
    seq_len: int
    batch: int
    kv_cache_dtype: str
    weight_dtype: str
    kv_scale_granularity: str
    block_size: int
    gpu_memory_utilization: float
    attention: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    kv_heads_per_device: int
    head_dim: int
    sliding_window_layers: int
    sliding_window: int | None
    max_position_embeddings: int | None
    bytes_per_token: int
    bytes_per_token_per_device: int
    bytes_per_request: int
    paged_bytes_per_request: int
    batch_bytes: int
    paged_batch_bytes: int
    paged_bytes_per_request_per_device: int
    num_params: int
    active_params: int
    weight_bytes: int
    weight_bytes_per_device: int
    windows_free_pages: bool = True
    device_memory_bytes: int | None = None
    usable_memory_bytes: int | None = None
    activation_peak_bytes: int = 0
    cache_budget_bytes: int | None = None
    num_blocks: int | None = None
    max_cached_tokens: int | None = None
    max_concurrent_requests: int | None = None
    weights_fit: bool | None = None
    batch_fits: bool | None = None
    min_tp_for_weights: int | None = None
    min_tp_for_batch: int | None = None
    decode: StepBound | None = None
    prefill: StepBound | None = None
    batch_sweep: tuple[SweepRow, ...] = ()
    ridge_batch: int | None = None
    kv_equals_weights_batch: float | None = None
    kv_bound_tokens_per_s: float | None = None
    host_link_seconds: float | None = None
    nvme_seconds: float | None = None
    offload_cpu_blocks: int | None = None
    offload_cpu_tokens: int | None = None
    offload_cpu_block_load_seconds: float | None = None
    offload_disk_blocks: int | None = None
    offload_disk_tokens: int | None = None
    offload_disk_block_load_seconds: float | None = None
    preempt_swap_seconds: float | None = None
    preempt_recompute_seconds: float | None = None
    draft_model: str | None = None
    draft_bytes_per_token: int | None = None
    draft_weight_bytes: int | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """A JSON-ready dict with the field names above (tuples become lists)."""
        d = asdict(self)
        d["batch_sweep"] = [dict(r) for r in d["batch_sweep"]]
        d["notes"] = list(self.notes)
        return d
