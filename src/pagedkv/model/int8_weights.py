"""Weight-only int8 linear layers (``--weight-dtype int8``): 1 byte per weight, fp32 math.

A decode step at small batch reads every weight once, so its time is the weights' bytes
over the memory bandwidth; int8 weights read a quarter of fp32's. Each output channel n of
a weight ``W [N, K]`` is stored as ``q[n] = round(W[n] / s[n])`` clamped to [-127, 127] with
``s[n] = max_k |W[n, k]| / 127`` (symmetric, per channel), and ``y = x . (q * s)^T`` is
computed by ``torch.ops.pagedkv.int8_linear`` (``kernels/cpu/csrc/int8_linear.cpp``), which
widens the int8 values to fp32 in registers: activations are never quantized (per-tensor
activation quantization, FBGEMM's dynamic int8, took SmolLM2's perplexity from 30.4 to 104;
see BENCHMARKS.md). The kernel is batch-invariant by construction, so this path needs no
row padding. Without the compiled kernel (no compiler, ``PAGEDKV_ATTENTION=reference``) the
product runs as the model's fp32 linear function over the dequantized weight, kept once
made: the same values at fp32 speed and memory (a warning says so).

The default model's GGUF holds Q4_1/Q8_0 weights, dequantized to fp32 at load; int8 here
re-quantizes those values (measured: perplexity -0.04%, with the LM head +0.02%).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

from pagedkv.kernels.cpu.ops import kernel_state as _kernel_state

QMAX = 127


class Int8Weight:
    """A linear weight ``[N, K]`` as int8 ``q`` and fp32 per-channel ``scale`` ``[N]``.

    Call it as ``w(x, bias)`` for ``x [M, K]`` fp32 -> ``[M, N]`` fp32.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.q, self.scale = q.contiguous(), scale.to(torch.float32).contiguous()
        self.shape = tuple(self.q.shape)
        self._dequantized: torch.Tensor | None = None  # made on first use without the kernel

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Weight":
        """Symmetric per-channel int8 of an fp32 ``weight [N, K]`` (an all-zero row gets scale 1).

        Raises:
            ValueError: a weight is NaN or infinite (no int8 value stands for it; the fp32
                engine would compute non-finite logits from it), or ``weight`` is not 2-D
                with K >= 1.
        """
        w = weight.to(torch.float32)
        if w.dim() != 2 or w.shape[1] == 0:
            raise ValueError(f"int8 weights: expected a 2-D weight [N, K >= 1], got shape {tuple(w.shape)}")
        if not torch.isfinite(w).all():
            raise ValueError("int8 weights: the checkpoint has a NaN or infinite weight")
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
        q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
        return cls(q, scale)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight these values stand for: ``q * scale``."""
        return self.q.to(torch.float32) * self.scale[:, None]

    def numel(self) -> int:
        return self.q.numel()

    @property
    def nbytes(self) -> int:
        """Bytes read per use: the int8 values and the fp32 scales."""
        return self.q.numel() + 4 * self.scale.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, fallback=F.linear) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]``; see :func:`quantized_linear`."""
        return quantized_linear(self, "int8_linear", (self.q, self.scale), x, bias, fallback)


def quantized_linear(w, op_name: str, args: tuple, x: torch.Tensor, bias, fallback) -> torch.Tensor:
    """``x`` times the quantized weight ``w`` by the kernel op ``op_name(x, *args)``, or, where
    the kernel is unavailable, by ``fallback(x, weight, bias)`` (the model's fp32 linear
    function: batch-invariant in that mode) over ``w.dequantize()``, made once and kept."""
    op = kernel_op(op_name)
    if op is None:
        if w._dequantized is None:
            w._dequantized = w.dequantize()
        return fallback(x, w._dequantized, bias)
    y = op(x.contiguous(), *args)
    return y if bias is None else y + bias



_state: dict[str, object] = {}


def kernel_op(name: str):
    """``torch.ops.pagedkv.<name>`` (``int8_linear``, ``ggml_linear``), or None where the
    kernels cannot be built or the reference attention mode asks for pure torch."""
    raw = os.environ.get("PAGEDKV_ATTENTION")
    hit = _state.get((raw, name))
    if hit is not None and hit[0] is _kernel_state():  # resolved before: this runs for every product
        return hit[1]
    op = _resolve(name)
    _state[(raw, name)] = (_kernel_state(), op)
    return op


def _resolve(name: str):
    from pagedkv.kernels.cpu.library import KernelBuildError, load_kernel
    from pagedkv.kernels.cpu.ops import attention_mode

    if attention_mode() == "reference":
        _warn_fallback("PAGEDKV_ATTENTION=reference")
        return None
    if name not in _state:
        try:
            load_kernel()
            _state[name] = getattr(torch.ops.pagedkv, name, None)  # None: not built for this CPU
        except KernelBuildError as e:
            _state[name] = None
            _warn_fallback(f"the kernels cannot be built here: {e}")
    return _state[name]


def _warn_fallback(why: str) -> None:
    if "warned" not in _state:
        _state["warned"] = True
        warnings.warn(f"pagedkv: quantized weights without their kernel ({why}): the products run in torch "
                      "(fp32 over dequantized copies, or the int8-activation recipe's torch reference: the same "
                      "numbers), as slow as float32 weights or slower, and larger", RuntimeWarning, stacklevel=4)


def weight_bytes(w) -> int:
    """Bytes of a weight as stored: a tensor's, an :class:`Int8Weight`'s or a GGML one's."""
    return int(w.nbytes)
