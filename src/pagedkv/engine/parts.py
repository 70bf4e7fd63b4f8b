"""An engine's parts from an EngineConfig: model, tokenizer, KV spec, KV manager, KV cache.

The pool is sized by :meth:`KVCacheSpec.num_blocks_for` on ``kv_cache_memory`` (or set by
``num_blocks``): the same arithmetic ``pagedkv plan`` prints. With a draft model
(``speculative_config`` method ``draft_model``) a page holds both models' layers, so the
same budget holds fewer pages (:func:`pagedkv.kv.spec.pool_num_blocks`). What is built
from the parts (connector, scheduler, runner) is :mod:`pagedkv.engine.build`'s.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace

from pagedkv.config.engine import CPU_KV_CACHE_MEMORY, EngineConfig
from pagedkv.core.kv_layout import kv_groups
from pagedkv.core.limits import cache_max_model_len, check_streaming, resolve_max_model_len
from pagedkv.kv.groups import SlidingWindowSpec, shared_page_slots, windows_free_pages
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.spec import KVCacheSpec, pool_cache_bytes, pool_num_blocks
from pagedkv.kv_cache.storage import KVCacheStorage
from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import LlamaModel
from pagedkv.model.load import engine_calibration_ids, load_model
from pagedkv.model.loader import ModelFiles, load_tokenizer, resolve_model
from pagedkv.model.partition import local_config, partition
from pagedkv.worker.device import check_features, compute_dtype, resolve_device
from pagedkv.worker.kv_scales import calibrate_static_scales
from pagedkv.worker.memory import MemoryProfile, profile_step

#: Part of every block hash: bump when the KV a model writes for the same tokens changes
#: (RoPE, attention, quantization code), so no tier serves pages the running code would not write.
KV_FORMAT_VERSION = "1"


@dataclass
class DraftParts:
    """The draft model of ``draft_model`` speculative decoding and its per-layer KV spec."""
    files: ModelFiles
    model: LlamaModel
    kv_spec: KVCacheSpec


@dataclass
class EngineParts:
    """What :func:`build_parts` makes: the model and its tokenizer, the KV spec (bytes per
    token and page), the KV manager (pool, block tables: bookkeeping only) and the KV cache
    (the page tensors), and the length limits they settle; on a GPU sized by ``memory``
    (:mod:`pagedkv.worker.memory`) unless a budget or block count was given."""
    files: ModelFiles
    model: LlamaModel
    tokenizer: object
    kv_spec: KVCacheSpec
    kv_manager: KVCacheManager
    kv_cache: KVCacheStorage
    max_model_len: int
    eos_token_ids: frozenset[int]
    draft: DraftParts | None = None
    memory: MemoryProfile | None = None


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


def kv_dtype(config: EngineConfig, compute: str = "float32") -> str:
    """The KV pages' dtype: ``kv_cache_dtype``, or the compute dtype's name for ``auto``."""
    return compute if config.kv_cache_dtype == "auto" else config.kv_cache_dtype


def cache_keys(config: EngineConfig, files: ModelFiles, kv_spec: KVCacheSpec, draft: DraftParts | None,
               compute: str = "float32") -> tuple[tuple[str, str], ...]:
    """The tagged fields every block hash of this engine carries: whatever changes the KV a
    model writes for the same tokens (format version, model and weights, dtypes, block size,
    scales, streaming's window, a draft's weights), so no cache or tier shares pages across them."""
    keys = (("kv_format", KV_FORMAT_VERSION), ("model", str(files.folder.name)), ("weights", files.weights_version),
            ("kv_dtype", kv_spec.dtype), ("block_size", str(config.block_size)),
            ("kv_scale", config.kv_cache_scale if kv_spec.is_quantized else "none"),
            ("weight_dtype", config.weight_dtype), ("activation_dtype", config.activation_dtype))
    if config.kv_eviction == "streaming":  # a token's KV depends on what the tokens before it saw
        keys += (("kv_eviction", f"{config.kv_eviction}:{config.num_sink_tokens}:{config.kv_window_tokens}:"
                                 f"{config.streaming_positions}"),)
    if draft is not None:  # pages hold the draft's KV too: never share them with other drafts
        keys += (("draft", str(draft.files.folder.name)), ("draft_weights", draft.files.weights_version))
    if compute != "float32":  # another compute dtype writes other KV for the same tokens
        keys += (("compute_dtype", compute),)
    return keys


def build_parts(config: EngineConfig, tp=None) -> EngineParts:
    """The engine's parts; with ``tp`` (this process's rank of a tensor-parallel group:
    ``rank``, ``world``, ``all_reduce``; :mod:`pagedkv.distributed`) the model holds its
    share (:mod:`pagedkv.model.partition`) and the pages its KV heads, while the pool is
    sized for the rank holding the most heads, so every rank has the same page ids. Every
    rank calls this in the same order: the calibrations run collectives."""
    files = resolve_model(config.model)
    cfg = files.config
    device = resolve_device(config)
    dtype = compute_dtype(config, device)
    check_features(config, device, dtype)
    compute = str(dtype).removeprefix("torch.")
    check_streaming(config, cfg)
    max_len = resolve_max_model_len(cfg, config.max_model_len, config.kv_eviction == "streaming")
    kvd = kv_dtype(config, compute)
    kv_spec = cfg.kv_spec(kvd, config.block_size, config.tensor_parallel_size, config.kv_cache_scale)
    part = partition(cfg, tp.rank, tp.world) if tp is not None else None
    own = local_config(cfg, part).kv_spec(kvd, config.block_size, 1, config.kv_cache_scale) if part else kv_spec
    tokenizer = load_tokenizer(files.folder)
    draft = build_draft(config, cfg, tokenizer, kvd, device.type, compute)
    if draft is not None:  # the draft runs at every position: the shorter limit holds
        max_len = min(max_len, draft_max_model_len(draft, config.max_model_len))
    groups = kv_groups(config, cfg, draft is not None)
    if windows_free_pages(cfg.layer_windows) and len(groups) == 1 and not isinstance(groups[0].spec, SlidingWindowSpec):
        warnings.warn("pagedkv: this model's window layers keep every page here (a draft model, an offload tier or "
                      "the contiguous allocator reads whole tables: one KV group holds every layer), so the same "
                      "memory holds fewer tokens than without them; `pagedkv plan` shows both", stacklevel=2)
    slots = shared_page_slots(groups)  # equal window and full groups share page tensors, else every page
    windows = any(isinstance(g.spec, SlidingWindowSpec) for g in groups)  # window pages go back
    kv_spec = replace(kv_spec, page_layers=0 if slots is None else max(slots) + 1,  # holds every layer (a tier, ...)
                      page_windows=windows)
    own = replace(own, page_layers=kv_spec.page_layers, page_windows=windows)
    if draft is not None:  # the draft reads the target's one table: its pages hold every layer too
        draft = replace(draft, kv_spec=replace(draft.kv_spec, page_layers=0, page_windows=False))
    specs = (kv_spec,) if draft is None else (kv_spec, draft.kv_spec)
    load = lambda: load_model(config, files, tokenizer, part, tp.all_reduce if tp is not None else None,  # noqa: E731
                              device.type, compute)
    model, memory = None, None
    budget = config.kv_cache_memory or (CPU_KV_CACHE_MEMORY if device.type == "cpu" else None)
    if config.num_blocks is None and budget is None:  # a GPU: what is left after the weights and one step
        model = load()
        memory = profile_step(model, own, config.max_num_batched_tokens, config.max_num_seqs)
        budget = memory.kv_budget(config.gpu_memory_utilization)
    num_blocks = config.num_blocks or pool_num_blocks(specs, budget)
    if device.type == "cpu":
        check_fits_in_ram(pool_cache_bytes(specs, num_blocks))
    kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                cache_keys(config, files, kv_spec, draft, compute), groups)
    max_len = cache_max_model_len(config, kv_manager, max_len)
    model = model or load()
    kv_cache = KVCacheStorage(own, kv_manager.pool.num_pages, device=str(device),
                              draft_spec=draft.kv_spec if draft else None, layer_slots=slots)  # page 0: null page
    if kv_spec.is_quantized and kv_spec.scale_granularity != "per-token-head":
        # the model's own length limit, not the cache's: scales must not depend on the cache size
        calibrate_static_scales(model, kv_cache, engine_calibration_ids(tokenizer, cfg))
        if draft is not None:
            calibrate_static_scales(draft.model, kv_cache.draft_view(),
                                    engine_calibration_ids(tokenizer, draft.files.config))
    return EngineParts(files, model, tokenizer, kv_spec, kv_manager, kv_cache, max_len,
                       eos_token_ids(cfg, tokenizer), draft, memory)


def eos_token_ids(cfg: ModelConfig, tokenizer) -> frozenset[int]:
    """The ids that end a request: the model config's EOS ids and the tokenizer's."""
    eos = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


def draft_max_model_len(draft: DraftParts, requested: int | None) -> int:
    """The draft's own position limit (:func:`resolve_max_model_len`), naming the draft
    when ``requested`` exceeds it."""
    try:
        return resolve_max_model_len(draft.files.config, requested)
    except ValueError:
        limit = resolve_max_model_len(draft.files.config, None)
        raise ValueError(f"max_model_len {requested} exceeds the draft model's limit of {limit} tokens "
                         f"({draft.files.name}; speculative decoding runs the draft at every position)") from None


def build_draft(config: EngineConfig, target: ModelConfig, tokenizer, dtype: str, device: str = "cpu",
                compute: str = "float32") -> DraftParts | None:
    """The draft model of a ``draft_model`` speculative config (else None), loaded like the
    target (weight dtype, numerics; on ``device`` in the ``compute`` dtype); ``dtype``: its
    KV pages'.

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
    kv_spec = dcfg.kv_spec(dtype, config.block_size, scale_granularity=config.kv_cache_scale)
    return DraftParts(files, load_model(config, files, tokenizer, device=device, dtype=compute), kv_spec)
