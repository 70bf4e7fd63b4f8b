"""GGML block weights times int8 activations (``--weight-dtype auto|int4 --activation-dtype int8``).

A single-stream decode step reads every weight once, so it should run at the memory bus;
widening each Q4_1 block to fp32 in registers (:mod:`pagedkv.model.ggml_weights`) costs
about four cycles per 32 weights here, which bounds the step by instructions, not bytes
(BENCHMARKS.md, issue 17). llama.cpp's CPU backend instead quantizes each activation row to
8 bits per block of 32 values (its ``block_q8_1``) and takes integer dot products of the
weights' quants with them (``ggml_vec_dot_q4_1_q8_1``), scaling once per block. This module
does the same, with this recipe (``torch.ops.pagedkv.ggml_a8_linear``,
``kernels/cpu/csrc/ggml_a8_linear.cpp``):

- activations, per row and block ``b`` of 32 values: ``dx = amax / 127`` (1 for an all-zero
  block; NaN for a block with a NaN or infinity, which makes the row's output NaN),
  ``xq = round-half-even(x / dx)``, ``sq = sum(xq)``;
- ``isum = sum_j xq_j q_j`` exactly in integers (``q``: Q4_1's nibbles 0..15 or Q8_0's int8);
- ``y = sum_b isum * (d_b * dx_b)``, plus for Q4_1 ``sum_b m_b * (dx_b * sq_b)`` added last;
  each float multiplication and addition rounded once, in block order.

So the weights are the GGUF file's bytes (rearranged in panels of 16 output channels), every
row's result depends on that row alone (batch-invariant), and the AVX2 kernel, the AVX-512
VNNI kernel and :func:`reference` give the same bits. Activation quantization changes the
numerics against the fp32-activation path (BENCHMARKS.md measures the perplexity cost).
"""

from __future__ import annotations

import torch

from pagedkv.model.ggml_weights import FORMATS, GROUP, Q4_1, GGMLWeight
from pagedkv.model.int8_weights import kernel_op

LANES = 16  # output channels per panel
QMAX = 127


class GGMLA8Weight:
    """A linear weight ``[N, K]`` of GGML blocks (Q4_1 or Q8_0) that multiplies int8
    activations. Call it as ``w(x, bias)`` for ``x [M, K]`` fp32 -> ``[M, N]`` fp32.

    ``packed``: uint8 ``[ceil(N / 16), K / 32 * 16 * block_bytes]``, the layout
    ``ggml_a8_linear.cpp`` documents.
    """

    def __init__(self, weight: GGMLWeight) -> None:
        self.qtype = weight.qtype
        self.shape = weight.shape
        self.packed = _pack(weight.blocks, weight.qtype, weight.shape[1])
        self._fields: tuple | None = None  # (d, m, q) as fp32, made where the kernel is not

    @property
    def format(self) -> str:
        return FORMATS[self.qtype][0]

    def fields(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """fp32 ``d [N, K/32]``, ``m [N, K/32]`` (None for Q8_0) and the quants ``q [N, K]``."""
        if self._fields is None:
            self._fields = _unpack(self.packed, self.qtype, self.shape)
        return self._fields

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` the blocks stand for (gguf-py's dequantize: ``d * q + m``
        for Q4_1, ``q * d`` for Q8_0)."""
        d, m, q = self.fields()
        w = q.view(q.shape[0], -1, GROUP) * d[..., None]
        return (w if m is None else w + m[..., None]).reshape(self.shape)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes read per use: the blocks of the real channels, scales included."""
        return self.shape[0] * self.shape[1] // GROUP * FORMATS[self.qtype][1]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, fallback=None) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` by the kernel, or by :func:`reference` where there is none
        (the same bits; ``fallback``, the model's fp32 linear function, is not used: the
        product's numerics are the recipe's, not fp32's)."""
        op = kernel_op("ggml_a8_linear")
        x = x.contiguous()
        y = op(x, self.packed, self.qtype, self.shape[0]) if op is not None else reference(self, x)
        return y if bias is None else y + bias


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 of the recipe for ``x [M, K]``: ``xq`` fp32 integer values ``[M, K/32, 32]``,
    ``dx [M, K/32]`` and ``sq [M, K/32]`` (fp32, exact integers)."""
    xb = x.to(torch.float32).reshape(x.shape[0], -1, GROUP)
    finite = torch.isfinite(xb).all(dim=-1)
    dx = xb.abs().amax(dim=-1) / QMAX
    dx = torch.where(dx > 0, dx, torch.ones_like(dx))
    dx = torch.where(finite, dx, torch.full_like(dx, float("nan")))
    xq = torch.round(xb / dx[..., None]).clamp_(-QMAX, QMAX)
    xq = torch.where(finite[..., None], xq, torch.zeros_like(xq))
    return xq, dx, xq.sum(dim=-1)


def reference(w: GGMLA8Weight, x: torch.Tensor) -> torch.Tensor:
    """The recipe in torch, bit for bit as the kernel: ``x [M, K]`` -> ``[M, N]``. Each
    block's integer dot is an fp32 product of integers whose partial sums stay below 2^24
    (32 * 127 * 127), so exact in any order."""
    d, m, q = w.fields()
    xq, dx, sq = quantize_activations(x)
    qb = q.view(q.shape[0], -1, GROUP)
    acc = torch.zeros(x.shape[0], w.shape[0])
    macc = torch.zeros_like(acc)
    for b in range(qb.shape[1]):
        isum = xq[:, b] @ qb[:, b].T
        acc = acc + isum * (d[None, :, b] * dx[:, b, None])
        if m is not None:
            macc = macc + m[None, :, b] * (dx[:, b] * sq[:, b])[:, None]
    return acc + macc if m is not None else acc


def convert_model(model) -> int:
    """Make every :class:`GGMLWeight` of ``model`` (layers and LM head) a :class:`GGMLA8Weight`;
    returns how many. Raises ValueError where there is none (activation quantization here
    needs weights kept in GGML blocks: a GGUF checkpoint with ``auto``, or ``int4``)."""
    count = 0
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            if isinstance(getattr(layer, name), GGMLWeight):
                setattr(layer, name, GGMLA8Weight(getattr(layer, name)))
                count += 1
    if isinstance(model.lm_head, GGMLWeight):
        model.lm_head = GGMLA8Weight(model.lm_head)
        count += 1
    if count == 0:
        raise ValueError("activation_dtype int8 with weight_dtype auto needs a checkpoint whose weights are "
                         "GGML Q4_1/Q8_0 blocks (a GGUF file); this one has none: use --weight-dtype int4 or int8")
    return count


def _fields_of(blocks: torch.Tensor, qtype: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A GGUF file's row-major blocks ``[N, G * bb]`` as fp16 ``d``, ``m`` ``[N, G]`` (raw
    bytes viewed) and the quants ``q`` ``[N, K]`` (uint8 nibbles for Q4_1, int8 for Q8_0)."""
    n, g = blocks.shape[0], k // GROUP
    raw = blocks.reshape(n, g, FORMATS[qtype][1])
    d = raw[..., 0:2].contiguous().view(torch.float16).reshape(n, g)
    if qtype == Q4_1:
        m = raw[..., 2:4].contiguous().view(torch.float16).reshape(n, g)
        qs = raw[..., 4:20]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(n, k)  # byte j: weights j and j + 16
        return d, m, q
    return d, None, raw[..., 2:34].contiguous().view(torch.int8).reshape(n, k)


def _pack(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Row-major GGUF blocks ``[N, G * bb]`` -> the kernel's panels (ggml_a8_linear.cpp)."""
    d, m, q = _fields_of(blocks, qtype, k)
    n, g = d.shape
    pad = -n % LANES
    if pad:
        d, q = torch.cat([d, d.new_zeros(pad, g)]), torch.cat([q, q.new_zeros(pad, k)])
        m = None if m is None else torch.cat([m, m.new_zeros(pad, g)])
    panels = (n + pad) // LANES

    def scales(t):  # [P * 16, G] fp16 -> [P, G, 32] bytes
        return t.reshape(panels, LANES, g).transpose(1, 2).contiguous().view(torch.uint8)

    if qtype == Q4_1:  # chunk c: byte 4r + i = q[r, 8c + i] | q[r, 8c + 4 + i] << 4
        qc = q.reshape(panels, LANES, g, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # [P, G, c, lo/hi, r, i]
        quants = (qc[:, :, :, 0] | (qc[:, :, :, 1] << 4)).reshape(panels, g, -1)
        parts = [scales(d), scales(m), quants]
    else:  # chunk c: byte 4r + i = q[r, 4c + i]
        qc = q.view(torch.uint8).reshape(panels, LANES, g, 8, 4).permute(0, 2, 3, 1, 4)
        parts = [scales(d), qc.reshape(panels, g, -1)]
    return torch.cat(parts, dim=-1).reshape(panels, -1).contiguous()


def _unpack(packed: torch.Tensor, qtype: int, shape: tuple[int, int]) -> tuple:
    """The inverse of :func:`_pack`, as fp32 ``d``, ``m`` (or None) ``[N, G]`` and ``q [N, K]``."""
    n, k = shape
    g, panels = k // GROUP, packed.shape[0]
    per = packed.reshape(panels, g, -1)

    def scales(t):  # [P, G, 32] bytes -> [N, G] fp32
        return t.contiguous().view(torch.float16).reshape(panels, g, LANES).transpose(1, 2).reshape(-1, g)[:n].float()

    if qtype == Q4_1:
        d, m = scales(per[..., :32]), scales(per[..., 32:64])
        qc = per[..., 64:].reshape(panels, g, 4, LANES, 4)
        q = torch.stack([qc & 0xF, qc >> 4], dim=3)  # [P, G, c, lo/hi, r, i]
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(-1, k)[:n]
        return d, m, q.float()
    d = scales(per[..., :32])
    q = per[..., 32:].contiguous().view(torch.int8).reshape(panels, g, 8, LANES, 4).permute(0, 3, 1, 2, 4)
    return d, None, q.reshape(-1, k)[:n].float()
