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

from pagedkv.config.engine import WEIGHT_DTYPES  # noqa: F401 - the names, re-exported
from pagedkv.model.ggml_a8 import GGMLA8Weight
from pagedkv.model.ggml_weights import FORMATS, Q4_1, Q8_0, GGMLWeight
from pagedkv.model.int8_weights import Int8Weight
from pagedkv.model.w8a8 import W8A8Weight

#: Fused linear weight of a layer -> the checkpoint names of its parts (``model.layers.i.`` + name).
FUSED = {"qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "o": ("self_attn.o_proj.weight",),
         "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
         "down": ("mlp.down_proj.weight",)}


EMBED = "model.embed_tokens.weight"


def prepare_state(state: dict, weight_dtype: str, num_layers: int) -> None:
    """Choose, in ``state`` (HF names -> fp32 tensors or the checkpoint's own
    :class:`GGMLWeight` blocks), the format of every layer's linear weights for
    ``weight_dtype`` ``auto`` or ``int4``, before the model fuses them: a fused group stays
    in blocks only when all its parts can.

    Raises:
        ValueError: ``int4`` with a layer width that is not a multiple of 32, or non-finite weights.
    """
    for i in range(num_layers):
        for names in FUSED.values():
            keys = [f"model.layers.{i}.{n}" for n in names]
            try:
                parts = _layer_parts([state[k] for k in keys], weight_dtype)
            except ValueError as e:
                raise ValueError(f"--weight-dtype {weight_dtype}: {keys[0]}: {e} (use auto, float32 or int8 "
                                 "for this model)") from None
            state.update(zip(keys, parts))


def _layer_parts(parts: list, weight_dtype: str) -> list:
    qtypes = {p.qtype if isinstance(p, GGMLWeight) else None for p in parts}
    if qtypes == {Q4_1} or (weight_dtype == "auto" and len(qtypes) == 1 and None not in qtypes):
        return parts
    fp32 = [p.dequantize() if isinstance(p, GGMLWeight) else p for p in parts]
    return fp32 if weight_dtype == "auto" else [GGMLWeight.quantize(p, Q4_1) for p in fp32]


def lm_head_for(head, embed_blocks: GGMLWeight | None, tied: bool, weight_dtype: str):
    """The LM head to keep: the checkpoint's blocks where it has them (the embedding's, for a
    tied head), else for ``int4`` Q8_0 made at load, else ``head`` as it is."""
    if isinstance(head, GGMLWeight):
        return head
    if tied and embed_blocks is not None:
        return embed_blocks
    return GGMLWeight.quantize(head, Q8_0) if weight_dtype == "int4" else head


def describe(model) -> str:
    """The formats a model's linear weights are kept in, with counts: ``"Q4_1 x 120, Q8_0 x 1"``."""
    counts: dict[str, int] = {}
    weights = [model.lm_head] + [getattr(layer, a) for layer in model.layers for a in FUSED]
    for w in weights:
        name = (FORMATS[w.qtype][0] if isinstance(w, GGMLWeight) else f"{w.format}xint8" if isinstance(w, GGMLA8Weight)
                else "int8" if isinstance(w, Int8Weight)
                else "W8A8" if isinstance(w, W8A8Weight) else "float32")
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{k} x {v}" for k, v in sorted(counts.items()))
