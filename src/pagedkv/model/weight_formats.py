"""Which format each linear weight of a model is kept in (``--weight-dtype``).

- ``float32``: every weight dequantized to fp32 (the reference; HF parity tests use it).
- ``int8``: every linear weight (the LM head too) re-quantized to symmetric per-channel int8
  (:mod:`pagedkv.model.int8_weights`).
- ``auto``: what the checkpoint holds. A GGUF file's Q4_1 and Q8_0 tensors stay in their
  blocks, byte for byte (:mod:`pagedkv.model.ggml_weights`); its float tensors, tensors of
  other ggml types (dequantized at load) and every weight of a Hugging Face folder are fp32.
- ``int4``: the layers' linear weights in Q4_1 (the file's own blocks where it holds Q4_1,
  else quantized at load with gguf-py) and the LM head in Q8_0 (the file's Q8_0/Q4_1 blocks
  where present), as llama.cpp's Q4_1 files keep a higher-precision output matrix.

Fused weights (q/k/v, gate/up) are kept quantized only when all their parts are.
"""

from __future__ import annotations

import torch

from pagedkv.config import WEIGHT_DTYPES  # noqa: F401 - the names, re-exported
from pagedkv.model.ggml_weights import FORMATS, Q4_1, Q8_0, GGMLWeight
#: Fused linear weight of a layer -> the checkpoint names of its parts (``model.layers.i.`` + name).
FUSED = {"qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "o": ("self_attn.o_proj.weight",),
         "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
         "down": ("mlp.down_proj.weight",)}


def keep_quantized(model, weight_dtype: str, raw: dict[str, GGMLWeight]) -> None:
    """Replace ``model``'s fp32 linear weights by :class:`GGMLWeight` ones as ``weight_dtype``
    (``auto`` or ``int4``) says. ``raw``: the checkpoint's own blocks by HF tensor name.

    Raises:
        ValueError: ``int4`` with a layer width that is not a multiple of 32, or non-finite weights.
    """
    for i, layer in enumerate(model.layers):
        for attr, names in FUSED.items():
            parts = [raw.get(f"model.layers.{i}.{n}") for n in names]
            setattr(layer, attr, _layer_weight(getattr(layer, attr), parts, weight_dtype))
        layer.in_norm, layer.post_norm = layer.in_norm.clone(), layer.post_norm.clone()
        if layer.qkv_bias is not None:
            layer.qkv_bias = layer.qkv_bias.clone()
    tied = model.lm_head is model.embed
    model.embed, model.norm = model.embed.clone(), model.norm.clone()
    head = raw.get("lm_head.weight") or (raw.get("model.embed_tokens.weight") if tied else None)
    if head is not None:
        model.lm_head = head
    elif weight_dtype == "int4":
        model.lm_head = GGMLWeight.quantize(model.lm_head, Q8_0)
    elif tied:
        model.lm_head = model.embed  # still one table


def _layer_weight(fp32: torch.Tensor, parts: list[GGMLWeight | None], weight_dtype: str):
    qtypes = {p.qtype if p is not None else None for p in parts}
    if weight_dtype == "auto":
        return GGMLWeight.concat(parts) if len(qtypes) == 1 and None not in qtypes else fp32
    if qtypes == {Q4_1}:
        return GGMLWeight.concat(parts)
    return GGMLWeight.quantize(fp32, Q4_1)


def describe(model) -> str:
    """The formats a model's linear weights are kept in, with counts: ``"Q4_1 x 120, Q8_0 x 1"``."""
    counts: dict[str, int] = {}
    weights = [model.lm_head] + [getattr(layer, a) for layer in model.layers for a in FUSED]
    for w in weights:
        name = (FORMATS[w.qtype][0] if isinstance(w, GGMLWeight)
                else "int8" if type(w).__name__ == "Int8Weight" else "float32")
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} x {v}" for k, v in sorted(counts.items()))
