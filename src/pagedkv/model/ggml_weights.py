"""GGML block-quantized linear layers kept quantized (``--weight-dtype auto|int4``).

A decode step at small batch reads every weight once, so its time is the weights' bytes
over the memory bandwidth. A GGUF file's Q4_1 tensors hold 32 weights in 20 bytes (fp16
scale ``d``, fp16 minimum ``m``, 32 nibbles ``q``: ``w = d * q + m``) and its Q8_0 ones in 34
(fp16 ``d``, 32 int8 ``q``: ``w = q * d``); see ggml-common.h (``block_q4_1``,
``block_q8_0``). :class:`GGMLWeight` keeps those bytes as the file has them, and
``torch.ops.pagedkv.ggml_linear`` (``kernels/cpu/csrc/ggml_linear.cpp``) widens each block in
registers to exactly the fp32 values gguf-py's ``dequantize`` gives, multiplied with fp32
activations: the products are those of the fp32 engine over the same dequantized weights
up to summation order, and no activation is quantized. The kernel is batch-invariant by
construction. Without the compiled kernel the product runs as the model's fp32 linear
function over the dequantized weight (a warning says so).

Formats are named by their ggml type: ``Q4_1`` (3) and ``Q8_0`` (8).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedkv.model.int8_weights import quantized_linear

GROUP = 32  # weights per block
PANEL = 8   # rows whose blocks the kernel reads interleaved (ggml_linear.cpp)
#: ggml type number -> (name, bytes per block of 32 weights).
FORMATS = {3: ("Q4_1", 20), 8: ("Q8_0", 34)}
Q4_1, Q8_0 = 3, 8


class GGMLWeight:
    """A linear weight ``[N, K]`` as GGML blocks: uint8 ``blocks [N, K / 32 * block_bytes]``.

    Call it as ``w(x, bias)`` for ``x [M, K]`` fp32 -> ``[M, N]`` fp32.

    Raises:
        ValueError: an unsupported ggml type, or ``blocks`` not ``[N, K / 32 * block_bytes]``.
    """

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int) -> None:
        if qtype not in FORMATS:
            raise ValueError(f"ggml type {qtype} is not one the kernel computes with (Q4_1=3, Q8_0=8)")
        if blocks.dtype != torch.uint8:
            raise ValueError(f"GGML blocks are bytes (uint8), got {blocks.dtype}")
        if (in_features < GROUP or in_features % GROUP or blocks.dim() != 2
                or blocks.shape[1] != in_features // GROUP * FORMATS[qtype][1]):
            raise ValueError(f"{FORMATS[qtype][0]} blocks of shape {tuple(blocks.shape)} do not hold rows "
                             f"of {in_features} weights")
        self.qtype = qtype
        self.shape = (int(blocks.shape[0]), int(in_features))
        self.packed = _panels(blocks, qtype, inverse=False)  # what the kernel reads
        self._dequantized: torch.Tensor | None = None  # made on first use without the kernel

    @property
    def blocks(self) -> torch.Tensor:
        """The blocks row by row, as a GGUF file stores them: uint8 ``[N, K / 32 * block_bytes]`` (a copy)."""
        return _panels(self.packed, self.qtype, inverse=True)

    @property
    def format(self) -> str:
        return FORMATS[self.qtype][0]

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: int) -> "GGMLWeight":
        """Quantize an fp32 ``weight [N, K]`` to ``qtype`` blocks with gguf-py (llama.cpp's
        reference rounding: per block the min and max for Q4_1, absmax / 127 for Q8_0).

        Raises:
            ValueError: K is not a multiple of 32, a weight is NaN or infinite, or a block's
                scale overflows fp16 (weights beyond ~1e6).
        """
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        w = weight.detach().to(torch.float32)
        if w.dim() != 2 or w.shape[1] == 0 or w.shape[1] % GROUP:
            raise ValueError(f"{FORMATS.get(qtype, ('?',))[0]} weights need rows of a multiple of {GROUP} "
                             f"weights; got shape {tuple(w.shape)}")
        if not torch.isfinite(w).all():
            raise ValueError("quantized weights: the checkpoint has a NaN or infinite weight")
        with np.errstate(over="ignore", invalid="ignore"):
            blocks = quantize(np.ascontiguousarray(w.numpy()), GGMLQuantizationType(qtype))
            out = cls(torch.from_numpy(np.ascontiguousarray(blocks)), qtype, w.shape[1])
            finite = bool(torch.isfinite(out.dequantize()).all())
        if not finite:
            raise ValueError(f"{out.format} cannot hold these weights: a block's scale overflows fp16 "
                             f"(largest |weight| {w.abs().max().item():.3g})")
        return out

    @staticmethod
    def concat(parts: list["GGMLWeight"]) -> "GGMLWeight":
        """Row-wise concatenation (fused q/k/v or gate/up) of weights of one format and width."""
        if len({(p.qtype, p.shape[1]) for p in parts}) != 1:
            raise ValueError("cannot fuse weights of different formats or widths")
        return GGMLWeight(torch.cat([p.blocks for p in parts]), parts[0].qtype, parts[0].shape[1])

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` these blocks stand for (gguf-py's dequantize)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks.numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes read per use: the blocks, scales included."""
        return self.packed.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, fallback=F.linear) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]``; see :func:`~pagedkv.model.int8_weights.quantized_linear`."""
        return quantized_linear(self, "ggml_linear", (self.packed, self.qtype), x, bias, fallback)


def _panels(blocks: torch.Tensor, qtype: int, inverse: bool) -> torch.Tensor:
    """Row-major blocks ``[N, G * block_bytes]`` to the kernel's panels, or back with
    ``inverse``: rows in panels of ``PANEL`` (the last holds N % PANEL), and for each group
    g a panel holds its rows' fp16 scales, then (Q4_1) their fp16 minimums, then their quant
    arrays (ggml_linear.cpp). The result has the same shape and bytes, and is contiguous."""
    fields = (2, 2, 16) if qtype == Q4_1 else (2, 32)  # d, (m,) qs of block_q4_1 / block_q8_0
    n, width = blocks.shape
    bb = sum(fields)
    g, full = width // bb, n - n % PANEL
    out = torch.empty_like(blocks)
    for start, rows, p in ((0, full, PANEL), (full, n - full, n - full)):
        if rows == 0:
            continue
        src = blocks[start:start + rows]
        if inverse:  # [panels, g, (p d | p m | p qs)] -> [panels, p, g, bb]
            parts = src.reshape(rows // p, g, p * bb).split([p * f for f in fields], dim=-1)
            blk = torch.cat([part.reshape(rows // p, g, p, f) for part, f in zip(parts, fields)], dim=-1)
            out[start:start + rows] = blk.transpose(1, 2).reshape(rows, width)
        else:
            blk = src.reshape(rows // p, p, g, bb).transpose(1, 2)  # [panels, g, p, bb]
            parts = blk.split(list(fields), dim=-1)
            out[start:start + rows] = torch.cat([part.reshape(rows // p, g, -1) for part in parts],
                                                dim=-1).reshape(rows, width)
    return out
