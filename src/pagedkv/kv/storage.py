"""KVCacheStorage: the per-layer K and V page tensors, sized from a KVCacheSpec.

Each layer holds two tensors of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``
in the KV storage dtype. Slot ``s`` is ``(s // block_size, s % block_size)``; viewing a
tensor as ``[num_blocks * block_size, num_kv_heads, head_dim]`` makes slots a flat index.
"""

from __future__ import annotations

import torch

from pagedkv.kv.spec import KVCacheSpec

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class KVCacheStorage:
    """K/V pages for every layer.

    Pages are allocated uninitialized (``torch.empty``: a 4 GiB zero fill costs seconds and
    touches every page); attention reads only slots that a step has written.

    Raises:
        ValueError: for a spec dtype with no torch storage here (quantized dtypes need scales).
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str = "cpu") -> None:
        if spec.dtype not in TORCH_DTYPES:
            raise ValueError(f"KV storage for dtype {spec.dtype!r} is not implemented")
        self.spec, self.num_blocks = spec, num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        dtype = TORCH_DTYPES[spec.dtype]
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes held by all page tensors (equals ``num_blocks * spec.page_size_bytes``)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. ``slot_mapping`` ``[T]`` int64; ``k``, ``v`` ``[T, kv_heads, head_dim]``."""
        flat = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        self.k[layer].view(flat).index_copy_(0, slot_mapping, k.to(self.k[layer].dtype))
        self.v[layer].view(flat).index_copy_(0, slot_mapping, v.to(self.v[layer].dtype))
