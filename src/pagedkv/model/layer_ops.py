"""The small ops a decoder layer is made of, each the kernel library's one call where it
applies (``kernels/cpu/csrc/layer_ops.cpp``), else torch's: RMSNorm, the gated MLP
activations (SwiGLU, GeGLU), weight fusion, and the weight tuple the one-call layer ops take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.kernels.cpu.ops import layer_op
from pagedkv.model.ggml_a8 import GGMLA8Weight
from pagedkv.model.ggml_weights import GGMLWeight
from pagedkv.model.int8_weights import Int8Weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (Zhang & Sennrich, 2019):
    the kernel library's one-call op (``csrc/layer_ops.cpp``), else torch's."""
    op = layer_op("rms_norm") if x.is_cpu and x.dtype == torch.float32 else None
    if op is not None and x.is_contiguous():
        return op(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[T, 2I]`` (gate first) -> ``[T, I]`` (SwiGLU)."""
    op = layer_op("silu_and_mul") if gate_up.is_cpu and gate_up.dtype == torch.float32 else None
    if op is not None and gate_up.is_contiguous():
        return op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU with the tanh approximation: Gemma's
    ``gelu_pytorch_tanh``) of ``gate_up`` ``[T, 2I]`` -> ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


#: the gated MLP's activation by config name (``hidden_act``)
ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


def fuse(parts: list):
    """Row-wise concatenation of a layer's weights (q/k/v, gate/up): tensors, or GGML blocks."""
    if all(isinstance(p, GGMLWeight) for p in parts):
        return GGMLWeight.concat(parts)
    return torch.cat(parts).contiguous()


A8 = 256  # decoder_layer's flag on a ggml type: the weight multiplies int8 activations


def op_weight(w) -> tuple:
    """A quantized weight as ``decoder_layer`` takes it: (values, scale or None, ggml type,
    plus ``A8`` for :class:`GGMLA8Weight`)."""
    if isinstance(w, Int8Weight):
        return w.q, w.scale, 0
    return w.packed, None, w.qtype | (A8 if isinstance(w, GGMLA8Weight) else 0)


def gemma_norms(w: dict, num_layers: int) -> None:
    """Gemma's RMSNorm scales by ``1 + weight`` (HF ``GemmaRMSNorm``): store ``1 + weight``
    in fp32 so every norm here is the same ``x * rsqrt(mean(x^2) + eps) * w``."""
    names = ["model.norm.weight"] + [f"model.layers.{i}.{n}_layernorm.weight" for i in range(num_layers)
                                     for n in ("input", "post_attention", "pre_feedforward", "post_feedforward")]
    names += [f"model.layers.{i}.self_attn.{n}_norm.weight" for i in range(num_layers) for n in "qk"]  # Gemma 3
    for name in names:
        if name in w:
            w[name] = 1.0 + w[name].to(torch.float32)
