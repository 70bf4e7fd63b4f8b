"""Parse a Hugging Face ``config.json`` dict into a :class:`ModelConfig`.

Key names differ across architectures (``num_hidden_layers`` / ``n_layer``,
``num_key_value_heads`` / ``num_kv_heads`` / ``multi_query``, ...); this module
knows the common ones. Where a config.json omits a key, the default is the one the
matching transformers config class uses (``FalconConfig`` ties embeddings and has
2,048 positions; ``Gemma2Config`` ties embeddings and alternates sliding and full
layers, sliding first).

Rules that calculators commonly get wrong and that this parser gets right:
``head_dim`` is the config's ``head_dim`` when present (Gemma 2: 256, not
hidden/heads = 224); KV heads default to the query heads only when no KV-head key
exists; ``sliding_window`` counts only when ``use_sliding_window`` is not false
(Qwen2 configs carry a window they do not use).
"""

from __future__ import annotations

from pagedkv.planner.models import MLAConfig, ModelConfig, MoEConfig

_TIED_DEFAULT = {"gemma": True, "gemma2": True, "gemma3_text": True, "falcon": True}
_MAX_POS_DEFAULT = {"falcon": 2048}
_NON_GATED_MLP = {"falcon", "gpt2", "gpt_neox", "gpt_bigcode", "opt", "bloom", "phi"}
_QKV_BIAS = {"qwen2", "qwen2_moe"}
_NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "falcon": 1}
_NORM_BIAS = {"falcon", "gpt2", "gpt_neox", "opt", "bloom", "phi"}


def _get(cfg: dict, keys: tuple[str, ...], default=None, required: str | None = None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if required:
        raise ValueError(f"config.json of {required} lacks {keys[0]}")
    return default


def _positive_int(value, key: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json of {name}: {key} must be a positive integer, got {value!r}")
    return value


def _kv_heads(cfg: dict, heads: int) -> int:
    kv = _get(cfg, ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"))
    if kv is not None:
        return kv
    return 1 if cfg.get("multi_query") else heads


def layer_windows(cfg: dict, num_layers: int, model_type: str) -> tuple[int | None, ...]:
    """Per layer, the sliding window in tokens or ``None`` (full attention); ``()`` if none slide."""
    w = cfg.get("sliding_window")
    if not w or cfg.get("use_sliding_window") is False:
        return ()
    if isinstance(cfg.get("layer_types"), list):
        return tuple(w if t == "sliding_attention" else None for t in cfg["layer_types"])
    if model_type == "gemma2":  # Gemma2Config: sliding on layers 0, 2, 4, ...
        return tuple(w if i % 2 == 0 else None for i in range(num_layers))
    if cfg.get("sliding_window_pattern"):  # Gemma 3: every pattern-th layer is full
        p = cfg["sliding_window_pattern"]
        return tuple(None if (i + 1) % p == 0 else w for i in range(num_layers))
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:  # Qwen2
        return tuple(w if i >= cfg["max_window_layers"] else None for i in range(num_layers))
    return (w,) * num_layers


def _mla(cfg: dict) -> MLAConfig | None:
    if not cfg.get("kv_lora_rank"):
        return None
    return MLAConfig(kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                     qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"],
                     q_lora_rank=cfg.get("q_lora_rank"))


def _moe(cfg: dict, intermediate: int) -> MoEConfig | None:
    experts = _get(cfg, ("num_local_experts", "n_routed_experts", "num_experts"))
    if not experts:
        return None
    return MoEConfig(
        num_experts=experts, experts_per_tok=cfg["num_experts_per_tok"],
        expert_intermediate_size=_get(cfg, ("moe_intermediate_size",), intermediate),
        num_shared_experts=cfg.get("n_shared_experts") or 0,
        first_dense_layers=cfg.get("first_k_dense_replace") or 0,
        layer_freq=cfg.get("moe_layer_freq") or 1,
        router_bias=cfg.get("topk_method") == "noaux_tc")


def parse(cfg: dict, name: str, source: str) -> ModelConfig:
    """Build a :class:`ModelConfig` from config.json contents.

    Raises:
        ValueError: on a missing or non-positive size, or heads that do not divide.
    """
    mt = str(cfg.get("model_type", ""))
    layers = _positive_int(_get(cfg, ("num_hidden_layers", "n_layer", "num_layers"), required=name),
                           "num_hidden_layers", name)
    hidden = _positive_int(_get(cfg, ("hidden_size", "n_embd", "d_model"), required=name), "hidden_size", name)
    heads = _positive_int(_get(cfg, ("num_attention_heads", "n_head"), required=name), "num_attention_heads", name)
    kv = _positive_int(_kv_heads(cfg, heads), "num_key_value_heads", name)
    mla_qk = (cfg.get("qk_nope_head_dim") or 0) + (cfg.get("qk_rope_head_dim") or 0) if cfg.get("kv_lora_rank") else 0
    head_dim = _positive_int(cfg.get("head_dim") or mla_qk or hidden // heads, "head_dim", name)
    vocab = _positive_int(_get(cfg, ("vocab_size",), required=name), "vocab_size", name)
    inter = _get(cfg, ("intermediate_size", "ffn_hidden_size", "n_inner"), 4 * hidden)
    if heads % kv:
        raise ValueError(f"config.json of {name}: {kv} KV heads do not divide {heads} query heads")
    windows = layer_windows(cfg, layers, mt)
    if windows and len(windows) != layers:
        raise ValueError(f"config.json of {name}: layer_types has {len(windows)} entries for {layers} layers")
    quant = cfg.get("quantization_config") or {}
    return ModelConfig(
        name=name, source=source, model_type=mt, num_layers=layers, hidden_size=hidden,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
        vocab_size=vocab, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", _TIED_DEFAULT.get(mt, False))),
        max_position_embeddings=_get(cfg, ("max_position_embeddings", "n_positions"), _MAX_POS_DEFAULT.get(mt)),
        layer_windows=windows, torch_dtype=_get(cfg, ("torch_dtype", "dtype")),
        quant_method=quant.get("quant_method") if isinstance(quant, dict) else None,
        qkv_bias=mt in _QKV_BIAS or bool(cfg.get("bias")) or bool(cfg.get("attention_bias")),
        attention_bias=bool(cfg.get("attention_bias")) or bool(cfg.get("bias")),
        gated_mlp=mt not in _NON_GATED_MLP,
        norms_per_layer=2 if cfg.get("new_decoder_architecture") else _NORMS_PER_LAYER.get(mt, 2),
        norm_bias=mt in _NORM_BIAS, mla=_mla(cfg), moe=_moe(cfg, inter))
