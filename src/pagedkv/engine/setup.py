"""Build an engine's parts from an EngineConfig: model, tokenizer, KV spec, pool, pages.

The pool is sized by :meth:`KVCacheSpec.num_blocks_for` on ``kv_cache_memory`` (or set by
``num_blocks``): the same arithmetic ``pagedkv plan`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.config import EngineConfig
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.kv.storage import KVCacheStorage
from pagedkv.model.config import ModelConfig, kv_spec_for
from pagedkv.model.llama import LlamaModel
from pagedkv.model.loader import ModelFiles, load_state_dict, load_tokenizer, resolve_model

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


def resolve_max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    """``max_model_len``: the request, capped by the model's positions and sliding window.

    Raises:
        ValueError: if ``requested`` exceeds what the model supports here.
    """
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:  # windowed attention is not implemented: stay inside one window
        limit = min(limit, cfg.sliding_window)
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's limit of {limit} tokens")
    return requested or limit


def kv_dtype(config: EngineConfig) -> str:
    return COMPUTE_DTYPE if config.kv_cache_dtype == "auto" else config.kv_cache_dtype


def build_parts(config: EngineConfig) -> EngineParts:
    files = resolve_model(config.model)
    cfg = files.config
    max_len = resolve_max_model_len(cfg, config.max_model_len)
    dtype = kv_dtype(config)
    spec = kv_spec_for(cfg, dtype, config.block_size)
    num_blocks = config.num_blocks or spec.num_blocks_for(config.kv_cache_memory)
    keys = (("model", str(files.folder.name)), ("weights", files.weights_version),
            ("kv_dtype", dtype), ("block_size", str(config.block_size)))
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, keys,
                        allocator=config.kv_allocator)
    model = LlamaModel(cfg, load_state_dict(files.folder))
    tokenizer = load_tokenizer(files.folder)
    eos = set(cfg.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    return EngineParts(files, model, tokenizer, spec, kv, KVCacheStorage(spec, num_blocks),
                       max_len, frozenset(eos))
