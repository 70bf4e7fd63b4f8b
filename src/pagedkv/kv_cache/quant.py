"""Quantized KV pages: int8 and fp8 (e4m3, e5m2) values with fp32 scales.

A value ``x`` is stored as ``q = clamp(x / scale, -qmax, qmax)`` (rounded to the nearest
int8, or cast to fp8) and read back as ``q * scale``. ``scale = amax / qmax`` over a group:

    per-token-head  one scale per token and KV head, written with the token (default);
    per-head        one static scale per layer and KV head;
    per-tensor      one static scale per layer;
    per-channel     keys: one static scale per layer, KV head and channel (KIVI-style);
                    values: per-token-head (see :func:`key_value_granularities`).

Static scales are calibrated once, at engine start, on a fixed text
(:mod:`pagedkv.worker.kv_scales`), and then fixed; later values beyond them saturate at
``qmax`` (clamped). That is where a
per-tensor scale loses: one outlier head sets the scale for all, the others keep few levels.

Per-token-head scales are stored as bfloat16 (2 bytes: fp32's range, 8 significant bits),
rounded *up* to the next bfloat16 so ``|x| / scale <= qmax`` still holds and nothing
saturates; the values are then quantized with exactly the stored scale. Static scales stay
fp32 (a few bytes per layer).

Robustness: NaN inputs are stored as 0 and values beyond +-1e38 (inf included) are clamped there, and
every scale is at least ``MIN_SCALE``, so no scale is ever zero, NaN or inf (an all-zero
group gets ``MIN_SCALE`` and reads back as exact zeros). Format maxima: int8 127,
fp8 e4m3 448, fp8 e5m2 57344 (OCP 8-bit floating point spec, "OFP8", 2023).
"""

from __future__ import annotations

import torch

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
STORAGE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MIN_SCALE = 1e-12
_LIMIT = 1e38  # inputs are clamped here so that qmax * scale stays finite in fp32


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """fp32 copy with NaN -> 0 and values (inf included) clamped to +-1e38."""
    return torch.nan_to_num(x.float(), nan=0.0, posinf=_LIMIT, neginf=-_LIMIT).clamp(-_LIMIT, _LIMIT)


def compute_scales(x: torch.Tensor, dtype: str, granularity: str) -> torch.Tensor:
    """Scales for ``x`` ``[T, kv_heads, head_dim]``: ``[T, kv_heads]`` per-token-head,
    ``[kv_heads]`` per-head, ``[1]`` per-tensor, ``[kv_heads, head_dim]`` per-channel.
    Raises ValueError for an unknown dtype or granularity."""
    if dtype not in QMAX:
        raise ValueError(f"{dtype!r} is not a quantized KV dtype ({', '.join(QMAX)})")
    a = sanitize(x).abs()
    if granularity == "per-token-head":
        amax = a.amax(dim=-1)
    elif granularity == "per-channel":
        amax = a.amax(dim=0)
    elif granularity == "per-head":
        amax = a.amax(dim=(0, 2))
    elif granularity == "per-tensor":
        amax = a.amax().reshape(1)
    else:
        raise ValueError(f"unknown scale granularity {granularity!r}")
    scale = (amax / QMAX[dtype]).clamp(min=MIN_SCALE)
    return round_up_to_bfloat16(scale) if granularity == "per-token-head" else scale


def round_up_to_bfloat16(s: torch.Tensor) -> torch.Tensor:
    """Positive fp32 ``s`` rounded up to the nearest bfloat16 value (returned as fp32, exactly
    representable in bfloat16). Incrementing a positive bfloat16's bit pattern gives the next
    larger value."""
    b = s.to(torch.bfloat16)
    below = b.float() < s
    bits = b.view(torch.int16) + below.to(torch.int16)
    return bits.view(torch.bfloat16).float()


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """Store ``x`` ``[T, H, D]`` with ``scale`` broadcastable to ``[T, H, 1]``; saturates at ``qmax``."""
    qmax = QMAX[dtype]
    y = (sanitize(x) / scale).clamp(-qmax, qmax)
    if dtype == "int8":
        return torch.round(y).to(torch.int8)
    return y.to(STORAGE_DTYPES[dtype])


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values ``q * scale``; ``scale`` broadcastable to ``q``'s shape."""
    return q.float() * scale


def key_value_granularities(granularity: str) -> tuple[str, str]:
    """The granularity keys and values are stored with under a ``--kv-cache-scale`` setting
    (they differ only for per-channel: static per-channel keys, per-token-head values)."""
    return (granularity, "per-token-head") if granularity == "per-channel" else (granularity, granularity)


def scale_view(scale: torch.Tensor, granularity: str) -> torch.Tensor:
    """Reshape a stored scale so it broadcasts against ``[T, kv_heads, head_dim]``."""
    if granularity == "per-token-head":
        return scale.unsqueeze(-1)        # [T, H] -> [T, H, 1]
    if granularity == "per-channel":
        return scale.unsqueeze(0)         # [H, D] -> [1, H, D]
    if granularity == "per-head":
        return scale.view(1, -1, 1)       # [H] -> [1, H, 1]
    return scale.view(1, 1, 1)
