"""Parse a Hugging Face ``config.json`` into a :class:`~pagedkv.model.config.ModelConfig`.

The one parser: the engine (:mod:`pagedkv.model.loader`) and the planner
(:mod:`pagedkv.planner.models`) both read config.json through :func:`parse`.

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
(Qwen2 configs carry a window they do not use), and only on the layers that slide
(``layer_types``; Gemma 2's alternation; Gemma 3's ``sliding_window_pattern``, 6 when
absent; Qwen2's layers from ``max_window_layers`` on). Rope settings are read from
``rope_theta``/``rope_scaling`` or, as transformers >= 5 writes them, ``rope_parameters``;
Gemma 3's window layers have their own RoPE (``rope_local_base_freq``, or
``rope_parameters["sliding_attention"]``).
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.model.config import MLAConfig, ModelConfig, MoEConfig

_TIED_DEFAULT = {"gemma": True, "gemma2": True, "gemma3_text": True, "falcon": True, "opt": True}
#: OPT's learned position table has 2 rows past max_position_embeddings (OPTLearnedPositionalEmbedding's offset)
_POSITION_OFFSET = {"opt": 2}
_MAX_POS_DEFAULT = {"falcon": 2048}
_NON_GATED_MLP = {"falcon", "gpt2", "gpt_neox", "gpt_bigcode", "opt", "bloom", "phi"}
_QKV_BIAS = {"qwen2", "qwen2_moe"}
_NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "falcon": 1}
#: q and k normed per head before RoPE (HF ``q_norm``/``k_norm``)
_QK_NORM = {"gemma3_text", "qwen3", "qwen3_moe"}
#: transformers' defaults for keys config.json files omit (Gemma2Config, Gemma3TextConfig, Qwen3Config;
#: the Hub's Gemma 3 text_config leaves out several)
_HF_DEFAULTS = {
    "gemma2": dict(rms_norm_eps=1e-6, max_position_embeddings=8192, num_key_value_heads=4, head_dim=256,
                   sliding_window=4096),
    "gemma3_text": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, num_key_value_heads=4, head_dim=256,
                        sliding_window=4096, vocab_size=262208),
    "qwen3": dict(rms_norm_eps=1e-6, head_dim=128),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")  # what layer_types the engine runs
_GEMMA3_PATTERN = 6  # Gemma3TextConfig: every sixth layer is full attention
_NORM_BIAS = {"falcon", "gpt2", "gpt_neox", "opt", "bloom", "phi"}
#: sizes checked to be positive integers wherever present
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
          "num_key_value_heads", "head_dim", "max_position_embeddings")


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
    if cfg.get("sliding_window_pattern") or model_type == "gemma3_text":  # Gemma 3: every p-th layer is full
        p = cfg.get("sliding_window_pattern") or _GEMMA3_PATTERN
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


def _scaling(params: dict) -> dict | None:
    """A ``rope_parameters`` entry as ``rope_scaling``: None for ``rope_type: default``."""
    return None if params.get("rope_type", params.get("type", "default")) == "default" else dict(params)


def _rope(cfg: dict, model_type: str) -> dict:
    """``rope_theta`` and ``rope_scaling``; transformers >= 5 keeps both in ``rope_parameters``,
    where ``rope_type: default`` means no scaling. Gemma 3 (``Gemma3TextConfig``): the full
    layers' RoPE is ``rope_theta`` (default 1e6) with ``rope_scaling``, the window layers' is
    ``rope_local_base_freq`` (default 1e4) unscaled, or per layer type in ``rope_parameters``."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        return dict(rope_theta=full.get("rope_theta", 1e6 if model_type == "gemma3_text" else 10000.0),
                    rope_scaling=_scaling(full), local_rope_theta=local.get("rope_theta", 10000.0),
                    local_rope_scaling=_scaling(local))
    scaling = cfg.get("rope_scaling") or (None if params.get("rope_type", "default") == "default" else dict(params))
    if model_type == "gemma3_text":
        return dict(rope_theta=cfg.get("rope_theta", params.get("rope_theta", 1e6)), rope_scaling=scaling,
                    local_rope_theta=cfg.get("rope_local_base_freq", 10000.0))
    return dict(rope_theta=cfg.get("rope_theta", params.get("rope_theta", 10000.0)), rope_scaling=scaling)


def _tokens(cfg: dict) -> dict:
    eos = cfg.get("eos_token_id")
    return dict(bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)))


def _sizes(cfg: dict, name: str) -> dict:
    """Layers, widths and head counts, each checked positive. Raises ValueError."""
    for key in _SIZES:
        if cfg.get(key) is not None:
            _positive_int(cfg[key], key, name)
    pos = lambda key, keys: _positive_int(_get(cfg, keys, required=name), key, name)  # noqa: E731
    layers = pos("num_hidden_layers", ("num_hidden_layers", "n_layer", "num_layers"))
    hidden = pos("hidden_size", ("hidden_size", "n_embd", "d_model"))
    heads = pos("num_attention_heads", ("num_attention_heads", "n_head"))
    kv = _positive_int(_kv_heads(cfg, heads), "num_key_value_heads", name)
    mla_qk = (cfg.get("qk_nope_head_dim") or 0) + (cfg.get("qk_rope_head_dim") or 0) if cfg.get("kv_lora_rank") else 0
    if heads % kv:
        raise ValueError(f"config.json of {name}: {kv} KV heads do not divide {heads} query heads")
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=_positive_int(cfg.get("head_dim") or mla_qk or hidden // heads, "head_dim", name),
                vocab_size=pos("vocab_size", ("vocab_size",)),
                intermediate_size=_get(cfg, ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim"), 4 * hidden))


def parse(cfg: dict, name: str = "", source: str = "") -> ModelConfig:
    """Build a :class:`ModelConfig` from config.json contents; ``name``/``source`` label it.

    Raises:
        ValueError: for a non-object, a missing or non-positive size, heads that do not
            divide, or a ``layer_types`` list of the wrong length.
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"config.json of {name} must hold a JSON object, got {type(cfg).__name__}")
    if isinstance(cfg.get("text_config"), dict) and cfg.get("num_hidden_layers") is None:
        # a multimodal wrapper (Gemma3ForConditionalGeneration, Llava...): its language model's
        # shape, under the wrapper's architecture (which the engine refuses by name)
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    mt = str(cfg.get("model_type", ""))
    cfg = {**_HF_DEFAULTS.get(mt, {}), **cfg}
    sizes = _sizes(cfg, name)
    windows = layer_windows(cfg, sizes["num_hidden_layers"], mt)
    if windows and len(windows) != sizes["num_hidden_layers"]:
        raise ValueError(f"config.json of {name}: layer_types has {len(windows)} entries for "
                         f"{sizes['num_hidden_layers']} layers")
    quant = cfg.get("quantization_config") or {}
    return ModelConfig(
        **sizes, name=name, source=source, model_type=mt, architecture=(cfg.get("architectures") or [""])[0],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", _TIED_DEFAULT.get(mt, False))),
        max_position_embeddings=_get(cfg, ("max_position_embeddings", "n_positions"), _MAX_POS_DEFAULT.get(mt)),
        layer_windows=windows, torch_dtype=_get(cfg, ("torch_dtype", "dtype")),
        quant_method=quant.get("quant_method") if isinstance(quant, dict) else None,
        qkv_bias=mt in _QKV_BIAS or bool(cfg.get("bias")) or bool(cfg.get("attention_bias")) or _opt_bias(cfg, mt),
        attention_bias=bool(cfg.get("attention_bias")) or bool(cfg.get("bias")) or _opt_bias(cfg, mt),
        mlp_bias=_opt_bias(cfg, mt) or bool(cfg.get("mlp_bias")), position_embeddings=_learned_positions(cfg, mt),
        gated_mlp=mt not in _NON_GATED_MLP,
        norms_per_layer=2 if cfg.get("new_decoder_architecture") else _NORMS_PER_LAYER.get(mt, 2),
        norm_bias=mt in _NORM_BIAS, mla=_mla(cfg), moe=_moe(cfg, sizes["intermediate_size"]),
        qk_norm=mt in _QK_NORM, rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), **_rope(cfg, mt), **_tokens(cfg),
        **_gemma(cfg, mt, sizes), unsupported=_unsupported(cfg))


def _unsupported(cfg: dict) -> tuple[str, ...]:
    """What the config asks for that the engine does not run (the planner sizes it anyway,
    such layers as full attention)."""
    out = []
    if cfg.get("use_bidirectional_attention"):
        out.append("bidirectional attention (use_bidirectional_attention: true)")
    types = cfg.get("layer_types")
    if isinstance(types, list):
        out += [f"layer type {t!r}" for t in dict.fromkeys(types) if t not in _LAYER_TYPES]
    return tuple(out)


def _gemma(cfg: dict, model_type: str, sizes: dict) -> dict:
    """Gemma 2/3's soft-capping, attention scale, GeGLU and embedding scale (``Gemma2Config``'s
    and ``Gemma3TextConfig``'s defaults where the file omits them: Gemma 3 caps nothing);
    nothing for other models."""
    act = _get(cfg, ("hidden_activation", "hidden_act"), "silu")
    if model_type not in ("gemma2", "gemma3_text"):
        return dict(hidden_act=act)
    cap = model_type == "gemma2"  # Gemma 3 replaced soft-capping with q/k norms; HF's Gemma 3 ignores the key
    return dict(attn_logit_softcapping=cfg.get("attn_logit_softcapping", 50.0) if cap else None,
                final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0 if cap else None),
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
                hidden_act=_get(cfg, ("hidden_activation", "hidden_act"), "gelu_pytorch_tanh"),
                embedding_multiplier=sizes["hidden_size"] ** 0.5)


def _opt_bias(cfg: dict, model_type: str) -> bool:
    """OPT's ``enable_bias`` (default true): biases on every attention and MLP projection."""
    return model_type == "opt" and bool(cfg.get("enable_bias", True))


def _learned_positions(cfg: dict, model_type: str) -> int:
    if model_type not in _POSITION_OFFSET:
        return 0
    return int(cfg.get("max_position_embeddings") or 0) + _POSITION_OFFSET[model_type]


def read_json(path: str | Path) -> dict:
    """The object in a config.json file.

    Raises:
        ValueError: for an unreadable file, invalid JSON, or a top level that is not an object.
    """
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a config.json: top level is not a JSON object")
    return cfg


def load_config(path: str | Path) -> ModelConfig:
    """Parse the config.json at ``path``, named after its folder (a file of another name:
    after the file). Raises ValueError (see :func:`parse`)."""
    path = Path(path)
    name = path.parent.name if path.name == "config.json" else path.stem
    return parse(read_json(path), name or str(path), str(path))
