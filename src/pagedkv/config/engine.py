"""EngineConfig: the one home of the engine's defaults, validated on construction.

Flag names follow vLLM's engine arguments (``--block-size``, ``--max-num-seqs``, ...).
Sizes given as text use binary suffixes for KiB/MiB/GiB (2^10, 2^20, 2^30 bytes) and
decimal ones for KB/MB/GB (1e3, 1e6, 1e9 bytes).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

DEFAULT_MODEL = "smollm2-135m-instruct"
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # as vLLM's --kv-cache-dtype fp8
KV_CACHE_SCALES = ("per-token-head", "per-head", "per-tensor", "per-channel")
KV_ALLOCATORS = ("paged", "contiguous")
KV_EVICTIONS = ("none", "streaming", "snapkv", "h2o")  # SlidingWindowManager; pagedkv.core.kv_eviction
STREAMING_POSITIONS = ("cache", "original")  # see LlamaModel.sink_tables
SCORED_EVICTIONS = ("snapkv", "h2o")  # score-based, with compaction
SCHEDULING_POLICIES = ("fcfs", "priority")
KV_OFFLOAD_POLICIES = ("lru", "lfu")
PREEMPTION_MODES = ("recompute", "swap", "auto")  # see pagedkv.core.preemption
WEIGHT_DTYPES = ("auto", "float32", "int8", "int4")  # see pagedkv.model.weight_formats
ACTIVATION_DTYPES = ("float32", "int8")  # see pagedkv.model.w8a8
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # vLLM's --dtype: the compute dtype
CPU_KV_CACHE_MEMORY = 4 * 2**30  # the CPU's default KV budget: 4 GiB, like vLLM's CPU backend

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text: str | int, name: str | None = None) -> int:
    """Parse ``"512MiB"``, ``"4GiB"``, ``"1.5GB"`` or a plain byte count into bytes;
    ``name`` (e.g. ``"kv_offload_memory (--kv-offload-memory)"``) leads the error.

    Raises:
        ValueError: for anything else, or a size that is not positive.
    """
    lead = f"{name}: " if name else ""
    if isinstance(text, bool):  # (True is an int: it would be one byte)
        raise ValueError(f"{lead}a size is a byte count or text such as 512MiB, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{lead}cannot parse size {text!r}; use e.g. 512MiB, 4GiB or 2GB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{lead}size must be positive, got {text!r}")
    return value


@dataclass
class EngineConfig:
    """Engine settings. Every default lives here.

    Each field is also a ``pagedkv`` flag (``block_size`` -> ``--block-size``): the entries
    below are its help text (:mod:`pagedkv.cli_common`), so they speak of other fields as
    flags would and state a default only where it is not the field's own.

    Attributes:
        model: model name, ``.gguf`` path or Hugging Face folder.
        block_size: tokens per KV page.
        kv_cache_dtype: KV storage dtype: auto (the compute dtype, float32 on CPU), a float
            type, or int8 / fp8 (= fp8_e4m3) / fp8_e5m2: quantized pages, scaled as
            ``kv_cache_scale`` says.
        kv_cache_scale: scale granularity of int8/fp8 pages: per-token-head, per-head or
            per-tensor (static, calibrated at start on a fixed text), or per-channel
            (KIVI-style: static per-channel keys, per-token values).
        weight_dtype: the format linear weights are kept in, multiplied with fp32 activations
            unless activation_dtype is int8 (:mod:`pagedkv.model.weight_formats`): float32; int8 (per-channel,
            a quarter of fp32's bytes per decode step); auto (what the checkpoint holds: a
            GGUF's Q4_1/Q8_0 blocks as stored, else fp32); int4 (Q4_1 layers, Q8_0 LM head).
        activation_dtype: what every linear layer's product (the LM head's too) takes as
            input: float32, or int8, quantized as it comes. With weight_dtype int8 that is
            W8A8 (per token, SmoothQuant; much faster at batch 16+, perplexity +0.5-0.7% on
            SmolLM2; :mod:`pagedkv.model.w8a8`); with auto or int4 the GGML blocks multiply
            activations quantized per 32 values, as llama.cpp's CPU backend does (one stream
            as fast as float32 activations, batches and prefill faster; greedy text can differ
            from float32's; :mod:`pagedkv.model.ggml_a8`). float32 weights refuse it.
        kv_cache_memory: KV cache budget, e.g. 512MiB or 2GB (KiB/MiB/GiB are powers of 2,
            KB/MB/GB of 10); ignored when ``num_blocks`` is set (default: 4GiB on the CPU, like
            vLLM's CPU backend; on a GPU what gpu_memory_utilization leaves after the weights and
            a profiled step's activations).
        device: where the model, its KV cache and every step run: auto (cuda when torch sees a
            GPU, else cpu), cpu or cuda.
        dtype: the compute dtype, vLLM's --dtype: auto (float32 on the CPU, where the C++
            kernels run and bf16 products are slower, 2.3x per token measured on an EPYC with
            AVX-512 BF16 and far more without it; bfloat16 on a GPU), float32, bfloat16 or
            float16. The KV pages default to it (kv_cache_dtype auto).
        gpu_memory_utilization: on a GPU, the fraction of its memory the engine may use for
            weights, activations and KV pages (as vLLM's): the KV cache gets what is left after
            the weights and the peak of one profiled step of max_num_batched_tokens.
        enforce_eager: on a GPU, run every step eagerly (no CUDA graphs for decode steps).
        num_blocks: exact number of KV pages, overriding ``kv_cache_memory``. A page is a
            block of every layer, or, for a model mixing window and full layers (Gemma 2/3),
            of one KV group's layers (a fraction of them: see ``stats().kv_bytes_per_token``
            and ``pagedkv plan``), so the same count holds fewer tokens there.
        kv_offload_memory: size of the CPU KV tier behind the cache, e.g. 2GiB (default:
            off): full prefix blocks are copied there as they are written and loaded back
            for later prompts that share them (:mod:`pagedkv.connectors.offload.cpu_tier`); needs
            prefix caching.
        kv_offload_policy: which tier block goes first when the tier is full: lru (least
            recently used) or lfu (least often hit); always a chain's tail before its head.
        kv_offload_dir: a directory for the disk KV tier behind the CPU tier (default: none):
            blocks are kept there as checked records and found again after a restart; one
            engine per directory; needs kv_offload_memory (--kv-offload-memory); the directory
            must be trusted: records hold prompt token ids and any writer there can inject KV
            (:mod:`pagedkv.connectors.offload.disk_records`).
        kv_offload_disk_size: the disk tier's budget, e.g. 20GiB (default with a
            kv_offload_dir: 4GiB).
        preemption_mode: what a preempted request's KV becomes: recompute (freed, computed
            again on resume), swap (copied to the CPU KV tier and back; needs
            ``kv_offload_memory``; recompute when the tier is full) or auto (whichever is
            predicted cheaper per request, from this engine's measured copy and compute rates).
        speculative_config: speculative decoding, as vLLM's: a dict or JSON text such as
            ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
            "prompt_lookup_max": 5}`` or ``{"method": "draft_model", "model": "<name or path>",
            "num_speculative_tokens": 4}`` (default: off; :mod:`pagedkv.worker.spec_decode`).
        max_num_seqs: most requests running in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_model_len: longest sequence (prompt + output) in tokens (default: the model's limit).
        enable_prefix_caching: share the KV pages of equal prompt prefixes across requests.
        kv_allocator: paged, or contiguous: reserve prompt + max_tokens slots per request at
            admission, the pre-paging baseline for benchmarks.
        kv_eviction: none, or streaming (StreamingLLM, Xiao et al. 2023): every layer attends
            to the first num_sink_tokens (--num-sink-tokens) positions and the last
            kv_window_tokens (--kv-window-tokens), and the pages in between go back to the
            pool, so a sequence may run past the model's positions (set max_model_len) in
            bounded memory. Changes outputs once a sequence is longer than the window.
            snapkv (SnapKV, Li et al. 2024): at the end of a prompt longer than
            kv_budget_tokens, the attention of its last kv_window_tokens queries picks the
            prompt tokens to keep (with num_sink_tokens first ones and those last ones); the
            others' KV leaves the cache and the kept tokens are compacted into fewer pages;
            h2o (H2O, Zhang et al. 2023): every query's attention accumulates on the keys
            it reads, and a request keeps kv_budget_tokens (heavy hitters, sinks, recent)
            at the end of a longer prompt and whenever its cache has grown a block past the
            budget, so decoding runs in bounded memory too.
        num_sink_tokens: attention-sink tokens kept with streaming, snapkv or h2o eviction
            (default 4).
        kv_window_tokens: recent tokens each position attends to with streaming eviction
            (required with it); with snapkv or h2o, the last tokens always kept (snapkv's
            observation window; default 32).
        kv_budget_tokens: tokens a request keeps at each snapkv or h2o eviction (required
            with them; a request's ``SamplingParams.kv_budget_tokens`` overrides it).
        streaming_positions: the positions streaming eviction attends with: cache (the
            default, StreamingLLM's: positions within the cache, so a query sits at most
            num_sink_tokens + kv_window_tokens - 1 positions after the sinks, within what the
            model was trained on) or original (every token at its place in the text: past
            the model's positions the sinks lie at distances it never saw).
        seed: seed of the engine's sampler, for requests without their own seed.
        scheduling_policy: fcfs (first come, first served), or priority: waiting requests
            are admitted by their ``priority`` (lower first; ties by arrival), and a
            preemption takes the running request of the highest value (as vLLM's).
        debug_invariants: check the KV manager's invariants after every step.
        batch_invariant: bit-identical results whatever the batching: every matrix product
            in fixed 16-row tiles (slower single-stream decode on CPU; see
            :mod:`pagedkv.numerics`); also on for every engine when ``PAGEDKV_BATCH_INVARIANT=1``
            is set.
        tensor_parallel_size: processes the model is split over (Megatron-style: attention
            heads and MLP columns; each rank's pages hold only its KV heads, and
            kv_cache_memory (--kv-cache-memory) is per rank). The engine starts the other
            ranks itself, or under torchrun every rank runs the same command
            (:mod:`pagedkv.distributed`). Not yet with a draft model, snapkv/h2o eviction or
            a KV tier.
        distributed_timeout: seconds a tensor-parallel collective may wait before the engine
            fails the step and stops (a dead rank is noticed at once; a hung one within this;
            loading the ranks may take ten times this).
        kv_transfer_config: disaggregated prefill/decode, as vLLM's flag: a dict or JSON text
            such as ``{"kv_connector": "TorchDistConnector", "kv_role": "kv_producer",
            "kv_ip": "127.0.0.1", "kv_port": 14579}`` (the consumer: ``kv_consumer``; kv_ip:kv_port
            is where the consumer finds the producer), also ``kv_lease_s`` and ``kv_timeout_s``
            (seconds), ``kv_load_failure_policy`` recompute|fail, ``kv_send_type`` GET (pull
            after the prefill) | PUT_ASYNC (the producer pushes each layer's pages during it)
            and ``kv_buffer_size`` (the consumer's bytes for pushes, default 1e9) (default: off). Put ``pagedkv
            proxy`` in front of the two servers; docs/disaggregated.md.
    Raises:
        ValueError: on an out-of-range value, naming the field.
    """

    model: str = DEFAULT_MODEL
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_scale: str = "per-token-head"
    weight_dtype: str = "auto"
    activation_dtype: str = "float32"
    kv_cache_memory: int | str | None = None
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    num_blocks: int | None = None
    kv_offload_memory: int | str | None = None
    kv_offload_policy: str = "lru"
    kv_offload_dir: str | None = None
    kv_offload_disk_size: int | str | None = None
    preemption_mode: str = "recompute"
    speculative_config: dict | str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_allocator: str = "paged"
    kv_eviction: str = "none"
    num_sink_tokens: int | None = None
    kv_window_tokens: int | None = None
    kv_budget_tokens: int | None = None
    streaming_positions: str = "cache"
    seed: int = 0
    scheduling_policy: str = "fcfs"
    debug_invariants: bool = False
    batch_invariant: bool = False
    tensor_parallel_size: int = 1
    distributed_timeout: float = 60.0
    kv_transfer_config: dict | str | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory (--kv-cache-memory)")
        self._check_device()
        if self.kv_offload_memory is not None:
            self.kv_offload_memory = parse_size(self.kv_offload_memory, "kv_offload_memory (--kv-offload-memory)")
        if self.kv_offload_disk_size is not None:
            if self.kv_offload_dir is None:
                raise ValueError("kv_offload_disk_size sizes the disk tier: set kv_offload_dir (--kv-offload-dir) too")
            self.kv_offload_disk_size = parse_size(self.kv_offload_disk_size,
                                                   "kv_offload_disk_size (--kv-offload-disk-size)")
        elif self.kv_offload_dir is not None:
            self.kv_offload_disk_size = parse_size("4GiB")
        if isinstance(self.kv_offload_dir, os.PathLike):
            self.kv_offload_dir = os.fspath(self.kv_offload_dir)
        if self.kv_offload_dir is not None and (not isinstance(self.kv_offload_dir, str) or "\0" in self.kv_offload_dir
                                                or not self.kv_offload_dir.strip()):
            raise ValueError(f"kv_offload_dir (--kv-offload-dir) must be a non-empty directory path, got "
                             f"{self.kv_offload_dir!r}")
        if self.kv_offload_dir is not None and not self.kv_offload_memory:
            raise ValueError("kv_offload_dir (--kv-offload-dir): the disk tier stages through the CPU tier; "
                             "set kv_offload_memory (--kv-offload-memory) too")
        from pagedkv.config.speculative import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.preemption_mode != "recompute" and not self.kv_offload_memory:
            raise ValueError(f"preemption_mode {self.preemption_mode!r} (--preemption-mode) swaps to the CPU KV "
                             "tier: set kv_offload_memory (--kv-offload-memory) too")
        if self.kv_offload_policy not in KV_OFFLOAD_POLICIES:
            raise ValueError(f"kv_offload_policy must be one of {KV_OFFLOAD_POLICIES}, got {self.kv_offload_policy!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _positive(name, getattr(self, name))
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.model, str):
            self.model = str(self.model)  # a pathlib.Path names a model too
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        self._check_eviction()
        self._check_parallel()
        if self.kv_allocator not in KV_ALLOCATORS:
            raise ValueError(f"kv_allocator must be 'paged' or 'contiguous', got {self.kv_allocator!r}")
        if self.kv_cache_scale not in KV_CACHE_SCALES:
            raise ValueError(f"kv_cache_scale must be one of {KV_CACHE_SCALES}, got {self.kv_cache_scale!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"activation_dtype must be one of {ACTIVATION_DTYPES}, got {self.activation_dtype!r}")
        if self.activation_dtype == "int8" and self.weight_dtype == "float32":
            raise ValueError("activation_dtype int8 multiplies quantized weights: it needs weight_dtype int8 "
                             "(W8A8), auto or int4 (GGML blocks, as llama.cpp), got 'float32'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        self.kv_cache_dtype = KV_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)

    def _check_device(self) -> None:
        """``device``, ``dtype`` and ``gpu_memory_utilization`` (raises ValueError naming the flag)."""
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")

    def _check_eviction(self) -> None:
        """The KV eviction fields (raises ValueError naming the flag); fills defaults."""
        if self.kv_eviction not in KV_EVICTIONS:
            raise ValueError(f"kv_eviction must be one of {KV_EVICTIONS}, got {self.kv_eviction!r}")
        if self.streaming_positions not in STREAMING_POSITIONS:
            raise ValueError(f"streaming_positions must be one of {STREAMING_POSITIONS}, "
                             f"got {self.streaming_positions!r}")
        if self.kv_eviction == "none" and (self.kv_window_tokens is not None or self.num_sink_tokens is not None):
            raise ValueError("kv_window_tokens (--kv-window-tokens) and num_sink_tokens (--num-sink-tokens) apply "
                             "to kv_eviction streaming, snapkv or h2o (--kv-eviction), which is off")
        if self.kv_eviction not in SCORED_EVICTIONS and self.kv_budget_tokens is not None:
            raise ValueError("kv_budget_tokens (--kv-budget-tokens) applies to kv_eviction snapkv or h2o "
                             "(--kv-eviction)")
        if self.kv_eviction != "streaming" and self.streaming_positions != "cache":
            raise ValueError("streaming_positions (--streaming-positions) applies to kv_eviction streaming "
                             "(--kv-eviction streaming)")
        if self.kv_eviction == "streaming" and self.kv_allocator == "contiguous":
            raise ValueError("kv_eviction streaming frees pages as the window slides: the contiguous allocator "
                             "(kv_allocator contiguous) reserves them all, so the two cannot be combined")
        if self.kv_eviction == "none":
            return
        if self.kv_eviction == "streaming" and self.kv_window_tokens is None:
            raise ValueError("kv_eviction streaming needs kv_window_tokens (--kv-window-tokens) >= 1, got None")
        if self.num_sink_tokens is None:
            self.num_sink_tokens = 4  # StreamingLLM's choice
        if self.kv_eviction in SCORED_EVICTIONS and self.kv_window_tokens is None:
            self.kv_window_tokens = 32  # SnapKV's observation window
        for name in ("num_sink_tokens", "kv_window_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "num_sink_tokens" else 1):
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= "
                                 f"{0 if name == 'num_sink_tokens' else 1}, got {v!r}")
        if self.kv_eviction in SCORED_EVICTIONS:
            self._check_scored()

    def _check_scored(self) -> None:
        need = self.num_sink_tokens + self.kv_window_tokens
        b = self.kv_budget_tokens
        if not isinstance(b, int) or isinstance(b, bool) or b < need:
            raise ValueError(f"kv_eviction {self.kv_eviction} needs kv_budget_tokens (--kv-budget-tokens) of at least "
                             f"num_sink_tokens + kv_window_tokens = {need}, "
                             + ("not set" if b is None else f"got {b!r}"))
        if self.kv_eviction == "snapkv" and self.kv_window_tokens > self.max_num_batched_tokens:
            raise ValueError(f"kv_window_tokens {self.kv_window_tokens} (snapkv's observation window) must fit "
                             f"in one step: max_num_batched_tokens is {self.max_num_batched_tokens}")
        for clash, on in (("speculative_config", self.speculative_config is not None),
                          ("kv_offload_memory", bool(self.kv_offload_memory)),
                          ("kv_allocator contiguous", self.kv_allocator == "contiguous")):
            if on:
                raise ValueError(f"kv_eviction {self.kv_eviction} cannot be combined with {clash} yet (compacted pages "
                                 "hold no token prefix a tier or draft could use)")

    def _check_parallel(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        t = self.distributed_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e6:
            raise ValueError(f"distributed_timeout must be a number of seconds in (0, 1e6), got {t!r}")
        from pagedkv.config.kv_transfer import KVTransferConfig
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_config is not None and self.kv_offload_memory:
            raise ValueError("kv_transfer_config and kv_offload_memory cannot be combined "
                             "(one KV connector per engine)")
        if self.kv_transfer_config is not None and self.kv_eviction in SCORED_EVICTIONS:
            raise ValueError(f"kv_transfer_config cannot be combined with kv_eviction {self.kv_eviction} yet "
                             "(a transferred prompt is never scored, so its budget would not hold)")
        if self.tensor_parallel_size == 1:
            return
        sc = self.speculative_config
        for clash, on in (("a draft model (speculative_config method draft_model)",
                           sc is not None and sc.method == "draft_model"),
                          (f"kv_eviction {self.kv_eviction} (its scores need every head)",
                           self.kv_eviction in SCORED_EVICTIONS),
                          ("a KV tier (kv_offload_memory)", bool(self.kv_offload_memory)),
                          ("kv_transfer_config", self.kv_transfer_config is not None),
                          ("kv_cache_scale per-tensor (each rank would calibrate over its own KV heads only)",
                           self.kv_cache_scale == "per-tensor"
                           and self.kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16"))):
            if on:
                raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} cannot be combined with "
                                 f"{clash} yet")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
