"""Build an engine's parts from an EngineConfig: model, tokenizer, KV spec, pool, pages.

The pool is sized by :meth:`KVCacheSpec.num_blocks_for` on ``kv_cache_memory`` (or set by
``num_blocks``): the same arithmetic ``pagedkv plan`` prints. With a draft model
(``speculative_config`` method ``draft_model``) a page holds both models' layers, so the
same budget holds fewer pages (:func:`pagedkv.kv.spec.pool_num_blocks`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace

from pagedkv.attention.dispatch import attention_mode
from pagedkv.config import SCORED_EVICTIONS, EngineConfig
from pagedkv.engine.admission import request_peak_blocks
from pagedkv.engine.calibrate import CALIBRATION_TOKENS, calibrate_static_scales, calibration_ids
from pagedkv.engine.kv_eviction import eviction_policy
from pagedkv.kv.groups import (FullAttentionSpec, KVCacheGroup, SlidingWindowSpec, group_layers, hybrid_page_layers,
                               shared_page_slots, single_group, windows_free_pages)
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.spec import KVCacheSpec, pool_cache_bytes, pool_num_blocks
from pagedkv.kv.storage import KVCacheStorage
from pagedkv.model.config import ModelConfig
from pagedkv.model.gguf_convert import read_blocks
from pagedkv.model.weight_formats import EMBED
from pagedkv.model.llama import LlamaModel
from pagedkv.model.ggml_a8 import convert_model as convert_ggml_a8
from pagedkv.model.w8a8 import quantize_model as quantize_w8a8
from pagedkv.model.partition import Partition, local_config, partition, shard_state
from pagedkv.model.loader import ModelFiles, load_state_dict, load_tokenizer, resolve_model
from pagedkv.model.validate import check_weights
from pagedkv.numerics import env_requests_invariance

COMPUTE_DTYPE = "float32"  # bf16 matmuls are ~200x slower on these CPUs


@dataclass
class EngineParts:
    files: ModelFiles
    model: LlamaModel
    tokenizer: object
    spec: KVCacheSpec
    kv: KVCacheManager
    storage: KVCacheStorage
    max_model_len: int
    eos_token_ids: frozenset[int]
    draft: "DraftParts | None" = None


@dataclass
class DraftParts:
    """The draft model of ``draft_model`` speculative decoding and its per-layer KV spec."""
    files: ModelFiles
    model: LlamaModel
    spec: KVCacheSpec


def resolve_max_model_len(cfg: ModelConfig, requested: int | None, streaming: bool = False) -> int:
    """``max_model_len``: the request, capped by the model's positions (sliding-window
    layers attend to their window at any length), unless ``streaming`` eviction bounds
    what a token sees (``EngineConfig.streaming_positions``); the default is the model's.

    Raises:
        ValueError: if ``requested`` exceeds what the model supports here.
    """
    limit = cfg.max_position_embeddings
    if requested is not None and requested > limit and not streaming:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit} tokens "
                         "(only --kv-eviction streaming runs past it)")
    return requested or limit


def check_streaming(config: EngineConfig, cfg: ModelConfig) -> None:
    """Streaming's cache positions must stay within the model's: sinks + window at most
    ``max_position_embeddings`` (raises ValueError); original positions past them warn."""
    if config.kv_eviction != "streaming":
        return
    limit, cache = cfg.max_position_embeddings, config.num_sink_tokens + config.kv_window_tokens
    if config.streaming_positions == "cache" and cache > limit:
        raise ValueError(f"num_sink_tokens + kv_window_tokens = {cache} exceeds the model's {limit} positions: "
                         "positions within the cache would too")
    if config.streaming_positions == "original" and (config.max_model_len or 0) > limit:
        warnings.warn(f"pagedkv: streaming with original positions past the model's {limit}: the sinks lie at "
                      "distances the model never saw (streaming_positions 'cache' keeps them within)",
                      RuntimeWarning, stacklevel=3)


def engine_calibration_ids(tokenizer, cfg: ModelConfig) -> list[int]:
    """The calibration ids an engine uses for static KV scales (:mod:`pagedkv.engine.calibrate`):
    at most ``CALIBRATION_TOKENS``, fewer only if the model's own length limit is shorter
    (never the cache's, so every engine of a model gets the same scales)."""
    return calibration_ids(tokenizer, min(CALIBRATION_TOKENS, resolve_max_model_len(cfg, None)))


#: Part of every block hash: bump when the KV a model writes for the same tokens changes
#: (RoPE, attention, quantization code), so no tier serves pages the running code would not write.
KV_FORMAT_VERSION = "1"


def cap_to_cache(max_len: int, cache_tokens: int, explicit: bool) -> int:
    """``max_model_len`` capped at what the whole cache holds when it came from the model
    (so ``max_tokens=None`` means "fill the cache", not "be rejected"). A value the user set
    is kept: requests over the cache are then rejected one by one, naming both limits."""
    if max_len <= cache_tokens or explicit:
        return max_len
    return cache_tokens


def cache_max_model_len(config: EngineConfig, kv: KVCacheManager, max_len: int) -> int:
    """``max_len`` capped by what one request can use of ``kv``'s pool: the longest request
    whose peak pages (:meth:`KVCacheManager.peak_blocks`, every group) fit the pool: the
    whole cache under full attention, any length when a window or H2O eviction bounds its
    pages (a long prompt is then refused by itself), and for window and full groups side by
    side what both hold at once (:func:`cap_to_cache` keeps a value the user set)."""
    num_blocks, step, policy = kv.pool.num_blocks, step_tokens(config), eviction_policy(config)

    def fits(total: int) -> bool:  # a one-token prompt: SnapKV scores none, H2O scores as it goes
        return request_peak_blocks(kv, total, 1, step, policy) <= num_blocks

    lo, hi = 0, max_len  # the peak grows with the length: the longest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    if lo == 0:
        raise ValueError(f"a KV cache of {num_blocks} blocks cannot hold a one-token request, which needs "
                         f"{kv.peak_blocks(1, step)} (a block in each of its {len(kv.groups)} KV groups at least): "
                         "give it more memory (--kv-cache-memory or --num-blocks)")
    return cap_to_cache(max_len, lo, config.max_model_len is not None)


def check_fits_in_ram(kv_bytes: int) -> None:
    """Refuse a KV cache larger than this machine's physical memory (it would be OOM-killed
    as it fills). Raises ValueError with both sizes in GiB (2^30 bytes)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if kv_bytes > ram:
        raise ValueError(f"a KV cache of {kv_bytes / 2**30:.1f} GiB does not fit in this machine's "
                         f"{ram / 2**30:.1f} GiB of memory")


def kv_dtype(config: EngineConfig) -> str:
    return COMPUTE_DTYPE if config.kv_cache_dtype == "auto" else config.kv_cache_dtype


def build_parts(config: EngineConfig, tp=None) -> EngineParts:
    """The engine's parts; with ``tp`` (this process's rank of a tensor-parallel group:
    ``rank``, ``world``, ``all_reduce``; :mod:`pagedkv.distributed`) the model holds its
    share (:mod:`pagedkv.model.partition`) and the pages its KV heads, while the pool is
    sized for the rank holding the most heads, so every rank has the same page ids. Every
    rank calls this in the same order: the calibrations run collectives."""
    files = resolve_model(config.model)
    cfg = files.config
    check_streaming(config, cfg)
    max_len = resolve_max_model_len(cfg, config.max_model_len, config.kv_eviction == "streaming")
    dtype = kv_dtype(config)
    spec = cfg.kv_spec(dtype, config.block_size, config.tensor_parallel_size, config.kv_cache_scale)
    part = partition(cfg, tp.rank, tp.world) if tp is not None else None
    own = local_config(cfg, part).kv_spec(dtype, config.block_size, 1, config.kv_cache_scale) if part else spec
    tokenizer = load_tokenizer(files.folder)
    draft = build_draft(config, cfg, tokenizer, dtype)
    if draft is not None:  # the draft runs at every position: the shorter limit holds
        max_len = min(max_len, draft_max_model_len(draft, config.max_model_len))
    groups = kv_groups(config, cfg, draft is not None)
    if windows_free_pages(cfg.layer_windows) and len(groups) == 1 and not isinstance(groups[0].spec, SlidingWindowSpec):
        warnings.warn("pagedkv: this model's window layers keep every page here (a draft model, an offload tier or "
                      "the contiguous allocator reads whole tables: one KV group holds every layer), so the same "
                      "memory holds fewer tokens than without them; `pagedkv plan` shows both", stacklevel=2)
    slots = shared_page_slots(groups)  # equal window and full groups share page tensors, else every page
    windows = any(isinstance(g.spec, SlidingWindowSpec) for g in groups)  # window pages go back
    spec = replace(spec, page_layers=0 if slots is None else max(slots) + 1,  # holds every layer (a tier, ...)
                   page_windows=windows)
    own = replace(own, page_layers=spec.page_layers, page_windows=windows)
    if draft is not None:  # the draft reads the target's one table: its pages hold every layer too
        draft = replace(draft, spec=replace(draft.spec, page_layers=0, page_windows=False))
    specs = (spec,) if draft is None else (spec, draft.spec)
    num_blocks = config.num_blocks or pool_num_blocks(specs, config.kv_cache_memory)
    check_fits_in_ram(pool_cache_bytes(specs, num_blocks))
    keys = (("kv_format", KV_FORMAT_VERSION), ("model", str(files.folder.name)), ("weights", files.weights_version),
            ("kv_dtype", dtype), ("block_size", str(config.block_size)),
            ("kv_scale", config.kv_cache_scale if spec.is_quantized else "none"),
            ("weight_dtype", config.weight_dtype), ("activation_dtype", config.activation_dtype))
    if config.kv_eviction == "streaming":  # a token's KV depends on what the tokens before it saw
        keys += (("kv_eviction", f"{config.kv_eviction}:{config.num_sink_tokens}:{config.kv_window_tokens}:"
                                 f"{config.streaming_positions}"),)
    if draft is not None:  # pages hold the draft's KV too: never share them with other drafts
        keys += (("draft", str(draft.files.folder.name)), ("draft_weights", draft.files.weights_version))
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, keys, groups)
    max_len = cache_max_model_len(config, kv, max_len)
    model = load_model(config, files, tokenizer, part, tp.all_reduce if tp is not None else None)
    storage = KVCacheStorage(own, kv.pool.num_pages, draft_spec=draft.spec if draft else None,
                             layer_slots=slots)  # page 0: null page
    if spec.is_quantized and spec.scale_granularity != "per-token-head":
        # the model's own length limit, not the cache's: scales must not depend on the cache size
        calibrate_static_scales(model, storage, engine_calibration_ids(tokenizer, cfg))
        if draft is not None:
            calibrate_static_scales(draft.model, storage.draft_view(),
                                    engine_calibration_ids(tokenizer, draft.files.config))
    eos = set(cfg.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    return EngineParts(files, model, tokenizer, spec, kv, storage, max_len, frozenset(eos), draft)


def step_tokens(config: EngineConfig) -> int:
    """The most tokens one request computes or holds slots for in a step: a prefill chunk
    (``max_num_batched_tokens``) plus speculative decoding's lookahead slots."""
    sc = config.speculative_config
    return config.max_num_batched_tokens + (sc.num_lookahead_tokens if sc is not None else 0)


def kv_groups(config: EngineConfig, cfg: ModelConfig, has_draft: bool) -> tuple[KVCacheGroup, ...]:
    """One group of every layer: a sliding-window group (pages before the window go back,
    :class:`~pagedkv.kv.single_type.SlidingWindowManager`) when every layer has the same
    window (or streaming eviction gives them one, with sinks) and nothing else reads those
    pages; window groups beside full-attention groups, all of equally many layers, when the
    model mixes one window with full layers (Gemma 2's halves; Gemma 3's 5:1 in groups of
    :func:`~pagedkv.kv.groups.hybrid_page_layers` layers; their pages share tensors:
    :func:`~pagedkv.kv.groups.shared_page_slots`); else full attention (correct for any model:
    attention itself applies each layer's window). Not yet for: a draft model (its layers
    attend to everything on the same tables), CPU/disk tiers and swap preemption (they copy
    whole tables), the contiguous allocator, or several windows."""
    windows, sinks = set(cfg.layer_windows), 0
    if config.kv_eviction in SCORED_EVICTIONS:
        if any(w is not None for w in windows):
            raise ValueError(f"kv_eviction {config.kv_eviction} needs a model with full attention in every layer "
                             "(this one has sliding-window layers)")
        return single_group(cfg.num_hidden_layers, config.block_size)
    if config.kv_eviction == "streaming":
        windows, sinks = {config.kv_window_tokens}, config.num_sink_tokens
    plain = not has_draft and config.kv_allocator == "paged" and config.kv_offload_memory is None  # (swap needs the tier)
    if len(windows) == 1 and None not in windows and plain:
        spec = SlidingWindowSpec(config.block_size, sliding_window=windows.pop(), num_sinks=sinks)
        return group_layers([spec] * cfg.num_hidden_layers)
    if plain and len(windows) == 2 and None in windows:  # window and full layers (Gemma 2, Gemma 3)
        full = FullAttentionSpec(config.block_size)
        groups = group_layers([full if w is None else SlidingWindowSpec(config.block_size, sliding_window=w)
                               for w in cfg.layer_windows], hybrid_page_layers(cfg.layer_windows))
        if shared_page_slots(groups) is not None:  # equal group sizes: pages shared (kv/groups.py)
            return groups
    return single_group(cfg.num_hidden_layers, config.block_size, config.kv_allocator == "contiguous")


def load_model(config: EngineConfig, files: ModelFiles, tokenizer, part: Partition | None = None,
               all_reduce=None) -> LlamaModel:
    """The decoder in ``files`` with the engine's weight and activation dtypes and numerics
    (``tokenizer`` makes the W8A8 calibration text); with ``part``, one tensor-parallel
    rank's share, its row-parallel outputs summed by ``all_reduce``."""
    blocks = (read_blocks(files.gguf_path, files.folder) if config.weight_dtype in ("auto", "int4") and files.gguf_path
              else {})
    kept = {k: v for k, v in blocks.items() if k != EMBED}  # used as stored: no fp32 copy is loaded
    state = load_state_dict(files.folder, skip=set(kept)) | kept
    check_weights(files.config, state)
    model_cfg = files.config
    if part is not None:
        state, model_cfg = shard_state(state, model_cfg, part), local_config(model_cfg, part)
        blocks = {k: state.get(k, v) if k != EMBED else v for k, v in blocks.items()}  # the shares, as kept
    invariant = config.batch_invariant or env_requests_invariance()
    if invariant and attention_mode() == "reference":
        warnings.warn("pagedkv: batch-invariant mode with PAGEDKV_ATTENTION=reference: the reference "
                      "attention's products change shape with the chunk, so log-probs can differ in "
                      "the last bits with batching; the fused kernel is batch-invariant", RuntimeWarning)
    w8a8 = config.activation_dtype == "int8" and config.weight_dtype == "int8"
    model = LlamaModel(model_cfg, state, batch_invariant=invariant,
                       weight_dtype="float32" if w8a8 else config.weight_dtype, quantized=blocks)
    if all_reduce is not None:
        model.set_all_reduce(all_reduce)
    if config.kv_eviction == "streaming":  # sinks + recent window (StreamingLLM) on every layer that reads more
        for layer in model.layers:  # (a model's own window inside the streaming one stays as trained: no sinks)
            if not layer.window or layer.window > config.kv_window_tokens:
                layer.window, layer.sinks = config.kv_window_tokens, config.num_sink_tokens
        if config.streaming_positions == "cache":
            model.streaming_cache_len = config.num_sink_tokens + config.kv_window_tokens
    if w8a8:  # calibrated on the fp32 model, then quantized (pagedkv.model.w8a8)
        quantize_w8a8(model, engine_calibration_ids(tokenizer, files.config))
        model.weight_dtype = config.weight_dtype
    elif config.activation_dtype == "int8":  # GGML blocks times int8 activations (pagedkv.model.ggml_a8)
        convert_ggml_a8(model)
    return model


def draft_max_model_len(draft: DraftParts, requested: int | None) -> int:
    """The draft's own position limit (:func:`resolve_max_model_len`), naming the draft
    when ``requested`` exceeds it."""
    try:
        return resolve_max_model_len(draft.files.config, requested)
    except ValueError:
        limit = resolve_max_model_len(draft.files.config, None)
        raise ValueError(f"max_model_len {requested} exceeds the draft model's limit of {limit} tokens "
                         f"({draft.files.name}; speculative decoding runs the draft at every position)") from None


def build_draft(config: EngineConfig, target: ModelConfig, tokenizer, dtype: str) -> DraftParts | None:
    """The draft model of a ``draft_model`` speculative config (else None), loaded like the
    target (weight dtype, numerics).

    Raises:
        FileNotFoundError: the draft is not found or has no tokenizer.
        ValueError: its vocabulary differs from the target's (its token ids would mean
            other tokens), or it is not a supported architecture.
    """
    sc = config.speculative_config
    if sc is None or sc.method != "draft_model":
        return None
    try:
        files = resolve_model(sc.model)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"speculative_config draft model: {e}") from None
    dcfg = files.config
    if dcfg.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {sc.model!r} has a vocabulary of {dcfg.vocab_size} tokens, the target "
                         f"{target.vocab_size}: a draft must use the target's tokenizer")
    if load_tokenizer(files.folder).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"draft model {sc.model!r} has a different tokenizer from the target's "
                         "(same size, other tokens): a draft must use the target's tokenizer")
    spec = dcfg.kv_spec(dtype, config.block_size, scale_granularity=config.kv_cache_scale)
    return DraftParts(files, load_model(config, files, tokenizer), spec)
