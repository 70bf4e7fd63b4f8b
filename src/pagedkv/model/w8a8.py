"""int8 weights times int8 activations (``--activation-dtype int8``): W8A8 linear layers.

At batch 16+ a decode step's layer products are bound by the CPU's arithmetic rate, not by
memory: fp32 FMAs here run at ~0.2 TFLOP/s, while int8 dot products (``vpdpbusd`` on
AVX-512 VNNI CPUs, ``vpmaddubsw`` on AVX2) run several times faster (BENCHMARKS.md, issue
17; ``torch.ops.pagedkv.w8a8_linear``, ``kernels/cpu/csrc/w8a8_linear.cpp``). Each product
then runs as:

- **weights**: per output channel symmetric int8 of ``W * s`` (``s`` the layer input's
  smoothing factors, below), ``q[n] = round(W[n] s / w_scale[n])`` clamped to [-127, 127];
- **activations**: quantized at run time, per token (row), from the row's own absolute
  maximum: ``a_scale[m] = max_k |x[m, k] / s[k]| / 127``, ``xq = round(x / s / a_scale)``.
  Inputs with a few huge channels lose the rest of the row to that scale, so
- **SmoothQuant** (Xiao et al., 2023, "SmoothQuant: Accurate and Efficient Post-Training
  Quantization for Large Language Models", eq. 4): per input channel
  ``s_k = max|X_k|^alpha / max|W_k|^(1 - alpha)`` with ``alpha = 0.5``, from the channel
  maxima of a fixed calibration text (:mod:`pagedkv.worker.kv_scales`'s), moves the
  activations' outliers into the weights: ``x W^T = (x / s)(W s)^T``.
- **grouped activation scales** where SmoothQuant does not suffice: the MLP's down
  projection, whose input ``silu(gate) * up`` has token-specific spikes, takes one
  activation scale per ``GROUP`` = 128 input channels, and the LM head one per
  ``HEAD_GROUP`` = 64 (after smoothing with ``HEAD_ALPHA`` = 0.3): one exact int8 dot per
  group, scaled and added in a fixed order.

Measured on SmolLM2-135M (wikitext-2 test, first 8,192 tokens, windows of 1,024; the
choices above were made on these numbers): fp32 weights 29.218; int8 weights with fp32
activations 29.293; per-token int8 activations everywhere 30.270 (+3.6%); SmoothQuant
(alpha 0.5) alone 29.656 (+1.5%); with down grouped 29.340; this recipe, LM head included,
29.368 (+0.51%; llama.cpp on the same GGUF, which quantizes activations to 8 bits per 32
values: 29.361). BENCHMARKS.md has the speed.

Numerics: the int8 products are exact integers, and every float operation is elementwise
per row, so each row's result does not depend on the batch (batch-invariant by
construction) nor on the CPU's vector width (the AVX2 and AVX-512 VNNI kernels and the torch
path give the same bits).
"""

from __future__ import annotations

import torch

from pagedkv.model.int8_weights import kernel_op

QMAX = 127
LANES = 16      # output channels per panel of the kernel's weight layout
GROUP = 128     # activation channels per scale for the down projection (when K % GROUP == 0)
ALPHA = 0.5     # SmoothQuant migration strength
EXACT_CHUNK = 1024  # channels per fp32 product of int8 values: 1024 * 127^2 < 2^24
MIN_AMAX = 1e-5  # floor for a channel maximum (an all-zero channel gets a finite factor)


class W8A8Weight:
    """A linear weight ``[N, K]`` as int8 ``q`` with fp32 per-channel ``w_scale [N]``, the
    input's smoothing factors ``smooth [K]`` (or None) and ``group`` input channels per
    activation scale (``K`` = one scale per token).

    Call it as ``w(x, bias)`` for ``x [M, K]`` fp32 -> ``[M, N]`` fp32.

    Raises:
        ValueError: ``group`` does not divide ``K``.
    """

    def __init__(self, q: torch.Tensor, w_scale: torch.Tensor, smooth: torch.Tensor | None, group: int) -> None:
        n, k = q.shape
        if group <= 0 or k % group or group % 4:
            raise ValueError(f"W8A8: an activation group of {group} channels must be a multiple of 4 dividing "
                             f"K = {k}")
        self.shape = (int(n), int(k))
        self.group = int(group)
        self.w_scale = w_scale.to(torch.float32).contiguous()
        self.inv_smooth = None if smooth is None else (1.0 / smooth.to(torch.float32)).contiguous()
        self.packed, self.wsum = _pack(q.to(torch.int8), self.group)  # what the kernel reads
        self._q_t: torch.Tensor | None = None  # [K, N] fp32 integer values, made where the kernel is not

    @classmethod
    def quantize(cls, weight: torch.Tensor, smooth: torch.Tensor | None = None, group: int | None = None
                 ) -> "W8A8Weight":
        """Per-channel int8 of the fp32 ``weight [N, K]`` times ``smooth [K]`` (if given).

        Raises:
            ValueError: a non-finite weight or factor, or a weight that is not 2-D.
        """
        w = weight.to(torch.float32)
        if w.dim() != 2 or w.shape[1] == 0:
            raise ValueError(f"W8A8: expected a 2-D weight [N, K >= 1], got shape {tuple(w.shape)}")
        if smooth is not None:
            if smooth.shape != (w.shape[1],) or not (torch.isfinite(smooth).all() and (smooth > 0).all()):
                raise ValueError(f"W8A8: smoothing factors must be {w.shape[1]} finite positive values")
            w = w * smooth.to(torch.float32)[None, :]
        if not torch.isfinite(w).all():
            raise ValueError("W8A8: a weight (times its smoothing factor) is NaN or infinite")
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
        q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
        return cls(q, scale, smooth, group or w.shape[1])

    @property
    def q(self) -> torch.Tensor:
        """The int8 weight ``[N, K]`` (a copy)."""
        n, k = self.shape
        panels = self.packed.shape[0]
        w = self.packed.view(panels, k // 4, LANES, 4).permute(0, 2, 1, 3).reshape(panels * LANES, k)
        return w[:n].contiguous()

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` this stands for, smoothing undone: ``q * w_scale / smooth``."""
        w = self.q.to(torch.float32) * self.w_scale[:, None]
        return w if self.inv_smooth is None else w * self.inv_smooth[None, :]

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes read per use: the int8 values (padded to 16 channels), the weight sums and
        scales, the smoothing factors."""
        extra = 0 if self.inv_smooth is None else self.inv_smooth.numel()
        return self.packed.numel() + 4 * (self.wsum.numel() + self.w_scale.numel() + extra)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, fallback=None) -> torch.Tensor:
        """``x [M, K]`` fp32 -> ``[M, N]`` fp32: the kernel ``torch.ops.pagedkv.w8a8_linear``
        where it is built (AVX2 and AVX-512 VNNI CPUs), else :meth:`reference`: the same
        bits. ``fallback`` is ignored (both paths are batch-invariant).

        Raises:
            ValueError: ``x`` is not float32 ``[M, K]``."""
        op = kernel_op("w8a8_linear")
        if op is None:
            return self.reference(x, bias)
        _check_input(x, self.shape[1])
        y = op(x.contiguous(), self.packed, self.wsum, self.w_scale, self.inv_smooth, self.group)
        return y if bias is None else y.add_(bias)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The product in torch, for where the kernel is not built: :func:`quantize_activations`,
        then per group the integer dots as fp32 products of integer-valued matrices in
        chunks of at most ``EXACT_CHUNK`` channels (every partial sum is an integer below
        2^24, so exact in any summation order; ``torch._int_mm`` is not exact on CPUs
        without VNNI), summed as int32, then scaled and added in group order."""
        if self._q_t is None:
            self._q_t = self.q.t().to(torch.float32).contiguous()  # [K, N], integer values
        _check_input(x, self.shape[1])
        xq, a_scale = quantize_activations(x, self.inv_smooth, self.group)
        xf = xq.reshape(x.shape[0], -1).to(torch.float32)
        y = None
        for g in range(self.shape[1] // self.group):
            isum = None
            for c in range(g * self.group, (g + 1) * self.group, EXACT_CHUNK):
                end = min(c + EXACT_CHUNK, (g + 1) * self.group)
                part = (xf[:, c:end] @ self._q_t[c:end]).to(torch.int32)
                isum = part if isum is None else isum.add_(part)
            part = isum.to(torch.float32) * a_scale[:, g:g + 1]
            y = part if y is None else y.add_(part)
        y = y.mul_(self.w_scale)
        return y if bias is None else y.add_(bias)


def _check_input(x: torch.Tensor, k: int) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"W8A8: expected float32 input [M, {k}], got {x.dtype} {tuple(x.shape)}")


def _pack(q: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``q [N, K]`` -> (``packed`` int8 ``[ceil(N / 16), K * 16]``, ``wsum`` int32
    ``[K / group, 16 * panels]``) as ``w8a8_linear.cpp`` reads them: panels of 16 channels,
    each k-quad's 16 x 4 weights together; padding channels zero."""
    n, k = q.shape
    panels = -(-n // LANES)
    qp = torch.zeros(panels * LANES, k, dtype=torch.int8)
    qp[:n] = q
    packed = qp.view(panels, LANES, k // 4, 4).permute(0, 2, 1, 3).reshape(panels, k * LANES).contiguous()
    wsum = qp.view(panels * LANES, k // group, group).sum(dim=2, dtype=torch.int32).t().contiguous()
    return packed, wsum


def quantize_activations(x: torch.Tensor, inv_smooth: torch.Tensor | None, group: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` fp32 -> (int8 ``[M, K / group, group]``, fp32 scales ``[M, K / group]``):
    symmetric, from each group's absolute maximum of ``x * inv_smooth`` (round half to even;
    an all-zero group gets scale 1; a group holding a NaN or infinity gets scale NaN and
    zeros, so the row's output is NaN, as an fp32 product's would be)."""
    m, k = x.shape
    xs = x if inv_smooth is None else x * inv_smooth
    xs = xs.reshape(m, k // group, group)
    amax = xs.abs().amax(dim=2)
    finite = torch.isfinite(xs).all(dim=2)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    q = torch.round(xs / scale[..., None]).clamp_(-QMAX, QMAX)
    q = torch.where(finite[..., None], q, torch.zeros_like(q)).to(torch.int8)
    return q, scale


def smoothing(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """SmoothQuant's factors ``s [K]`` for an input with channel maxima ``act_amax [K]`` into
    ``weight [N, K]``: ``max|X_k|^alpha / max|W_k|^(1 - alpha)``, maxima floored at
    :data:`MIN_AMAX`."""
    a = act_amax.to(torch.float32).clamp_min(MIN_AMAX)
    w = weight.to(torch.float32).abs().amax(dim=0).clamp_min(MIN_AMAX)
    return (a ** alpha / w ** (1 - alpha)).clamp_min(MIN_AMAX)


LAYER_WEIGHTS = ("qkv", "o", "gate_up", "down")
HEAD_ALPHA, HEAD_GROUP = 0.3, 64  # the LM head: milder smoothing, a scale per 64 channels


@torch.inference_mode()
def input_amax(model, token_ids: list[int]) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The channel maxima ``|x|`` ``[K]`` of each product's input over ``token_ids`` run
    through ``model`` (a :class:`~pagedkv.model.llama.LlamaModel` with fp32 weights) with fp32
    activations and attention (as the KV-scale calibration runs it): per layer, by weight
    name, and the LM head's (the final norm's output)."""
    out: list[dict[str, torch.Tensor]] = []
    saved = [layer.linear for layer in model.layers]
    try:
        for layer in model.layers:
            seen: dict[str, torch.Tensor] = {}
            names = {id(getattr(layer, n)): n for n in LAYER_WEIGHTS}

            def record(x, weight, bias=None, seen=seen, names=names, base=layer.linear):
                seen[names[id(weight)]] = x.abs().amax(dim=0)
                return base(x, weight, bias)
            layer.linear = record
            out.append(seen)
        hidden = model.dense_forward(token_ids)
    finally:
        for layer, fn in zip(model.layers, saved):
            layer.linear = fn
    return out, hidden.abs().amax(dim=0)


def quantize_model(model, token_ids: list[int]) -> None:
    """Make every linear weight of ``model`` (fp32) a :class:`W8A8Weight`: SmoothQuant
    factors (``ALPHA``) from ``token_ids`` and a scale per token for q/k/v, o and gate/up;
    a scale per ``GROUP`` channels for down; the LM head smoothed with ``HEAD_ALPHA`` and a
    scale per ``HEAD_GROUP`` channels (a group falls back to the whole row where it does not
    divide the width). The embedding table stays fp32 for row lookups.

    Raises:
        ValueError: no calibration tokens, a weight that is not fp32, or a layer width that
            is not a multiple of 4 (the kernel's unit).
    """
    if not token_ids:
        raise ValueError("W8A8 calibration needs at least one token")
    for layer in model.layers:
        for n in LAYER_WEIGHTS:
            w = getattr(layer, n)
            if not isinstance(w, torch.Tensor):
                raise ValueError(f"W8A8 quantizes fp32 weights; layer.{n} is {type(w).__name__}")
            if w.shape[1] % 4:
                raise ValueError(f"W8A8 needs layer widths that are multiples of 4; {n} has {w.shape[1]} inputs "
                                 "(use --activation-dtype float32)")
    maxima, head_amax = input_amax(model, token_ids)
    for layer, amax in zip(model.layers, maxima):
        for n in ("qkv", "o", "gate_up"):
            w = getattr(layer, n)
            setattr(layer, n, W8A8Weight.quantize(w, smoothing(amax[n], w)))
        layer.down = W8A8Weight.quantize(layer.down, group=_group(layer.down.shape[1], GROUP))
        layer.in_norm, layer.post_norm = layer.in_norm.clone(), layer.post_norm.clone()
        if layer.q_norm is not None:
            layer.q_norm, layer.k_norm = layer.q_norm.clone(), layer.k_norm.clone()
    head = model.lm_head
    model.lm_head = W8A8Weight.quantize(head, smoothing(head_amax, head, HEAD_ALPHA), _group(head.shape[1], HEAD_GROUP))
    model.embed, model.norm = model.embed.clone(), model.norm.clone()


def _group(k: int, want: int) -> int:
    return want if k % want == 0 else k
