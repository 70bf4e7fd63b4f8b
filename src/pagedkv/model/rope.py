"""Rotary position embedding (RoFormer, arXiv:2104.09864) in HF's "rotate half" layout.

Supported ``rope_scaling`` types: none/default, ``linear`` (positions divided by
``factor``) and ``llama3`` (Llama 3.1's frequency-dependent scaling, from Meta's
reference ``apply_scaling``: low frequencies divided by ``factor``, high ones kept,
a smooth blend between ``low_freq_factor`` and ``high_freq_factor``).
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, shape ``[head_dim // 2]``, fp32.

    Raises:
        ValueError: for a rope scaling type we do not implement.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions ``0..max_positions-1``.

    ``apply(x, positions)``: ``x`` is ``[T, heads, head_dim]``, ``positions`` ``[T]`` int64.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        self.inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), self.inv)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)                                          # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor, checked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions`` ``[T]``, each ``[T, 1, head_dim]`` (look up once per
        forward; every layer rotates with the same tables). Positions past the table (a
        streaming sequence longer than the model's positions) are computed row by row in
        float64, so a row's values never depend on the other rows; ``checked`` False skips
        that test (it reads a value back to the host: not inside a CUDA graph, whose
        positions stay below the table's length)."""
        if checked and positions.numel() and int(positions.max()) >= self.max_positions:
            return self._past_table(positions)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def _past_table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        past = positions >= self.max_positions
        inside = positions.clamp(max=self.max_positions - 1)
        cos, sin = self.cos[inside], self.sin[inside]
        freqs = torch.outer(positions[past].double(), self.inv.double())
        emb = torch.cat([freqs, freqs], dim=-1)
        cos[past], sin[past] = emb.cos().float(), emb.sin().float()
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.rotate(x, *self.cos_sin(positions))

    @staticmethod
    def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:meth:`rotate` in place where the kernel library's op takes ``x`` (fp32, heads
        contiguous; bit-identical to :meth:`rotate`), else :meth:`rotate`; returns the result."""
        from pagedkv.kernels.cpu.ops import layer_op

        op = layer_op("rope_rotate_") if x.is_cpu and x.dtype == torch.float32 else None
        if (op is not None and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.dim() == 3
                and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.is_contiguous() and sin.is_contiguous()):
            op(x, cos, sin)
            return x
        return RotaryEmbedding.rotate(x, cos, sin)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, head_dim]`` rotated by the tables of :meth:`tables`."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
