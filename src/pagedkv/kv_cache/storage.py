"""KVCacheStorage: the per-layer K and V page tensors, sized from a KVCacheSpec.

Each layer holds two tensors of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``
in the KV storage dtype. Slot ``s`` is ``(s // block_size, s % block_size)``; viewing a
tensor as ``[num_blocks * block_size, num_kv_heads, head_dim]`` makes slots a flat index.

Quantized dtypes (int8, fp8_e4m3, fp8_e5m2; see :mod:`pagedkv.kv_cache.quant`) also hold fp32
scales per layer for K and for V (fp32, but bfloat16 per token), shaped by the granularity:

    per-token-head  [num_blocks, block_size, num_kv_heads]   bfloat16, written with each token
    per-head        [num_kv_heads]                          static (see set_static_scales)
    per-tensor      [1]                                     static
    per-channel     K: [num_kv_heads, head_dim] static; V: as per-token-head

so ``num_blocks * spec.page_size_bytes + spec.static_bytes`` is exactly what is allocated.

With a draft model (speculative decoding, ``draft_spec``) the draft's layers follow the
target's: layers ``0 .. N-1`` are the target's, ``N .. N+M-1`` the draft's, each in its own
shape, and a page id addresses the same token slots in all of them. One page then holds a
block of both models' KV (:func:`pagedkv.kv.spec.pool_page_bytes`), so both caches share the
block tables, the pool accounting, prefix caching, tiers and rollback. The draft runs on
:meth:`KVCacheStorage.draft_view`.

With ``layer_slots`` (KV groups of equally many layers sharing page tensors:
:func:`pagedkv.kv.groups.shared_page_slots`) layer ``i`` reads and writes the page tensors of
slot ``layer_slots[i]``: ``self.k[i]`` is that slot's tensor, the same object for one layer
of each group, and a page id belongs to one group at a time, so it holds only that group's
layers. Static scales stay per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedkv.kv.spec import KVCacheSpec, check_pool_specs, pool_page_bytes
from pagedkv.kv_cache import quant
from pagedkv.kv_cache.pinned import pinned_empty

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                **quant.STORAGE_DTYPES}


def _empty(shape: tuple, dtype: torch.dtype, device: str, pin_memory: bool) -> torch.Tensor:
    return pinned_empty(shape, dtype) if pin_memory else torch.empty(shape, dtype=dtype, device=device)


def _check_slots(slots, spec: KVCacheSpec, draft_spec: KVCacheSpec | None) -> tuple[int, ...] | None:
    """``layer_slots`` validated against the spec: one slot per layer, ``spec.page_layers`` of
    them, each used by the same number of layers. Raises ValueError."""
    if slots is None:
        if spec.page_layers not in (0, spec.num_layers):
            raise ValueError(f"a spec of {spec.page_layers} layers per page needs layer_slots")
        return None
    slots = tuple(int(s) for s in slots)
    counts = [slots.count(i) for i in range(spec.page_layers)]
    if (draft_spec is not None or len(slots) != spec.num_layers or not spec.page_layers
            or sorted(set(slots)) != list(range(spec.page_layers)) or len(set(counts)) != 1):
        raise ValueError(f"layer_slots {slots} do not share {spec.page_layers} page slots evenly among "
                         f"{spec.num_layers} layers (and no draft model)")
    return slots


class LayerKV(NamedTuple):
    """One layer's pages and, for quantized dtypes, their scales (else None)."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


class KVCacheStorage:
    """K/V pages for every layer.

    Pages are allocated uninitialized (``torch.empty``: a 4 GiB zero fill costs seconds and
    touches every page); attention reads only slots that a step has written, except the
    null page 0 (the table entry of a page a sliding window gave back), which is zeroed so
    a read of it is finite.

    Raises:
        ValueError: for a spec dtype with no storage here.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str = "cpu",
                 draft_spec: KVCacheSpec | None = None, layer_slots: tuple[int, ...] | None = None,
                 pin_memory: bool = False) -> None:
        if spec.dtype not in TORCH_DTYPES:
            raise ValueError(f"KV storage for dtype {spec.dtype!r} is not implemented")
        self.spec, self.num_blocks, self.draft_spec = spec, num_blocks, draft_spec
        self.specs = (spec,) if draft_spec is None else (spec, draft_spec)
        check_pool_specs(self.specs)
        self.layer_specs = [s for s in self.specs for _ in range(s.num_layers)]
        self.layer_slots = _check_slots(layer_slots, spec, draft_spec)
        dtype = TORCH_DTYPES[spec.dtype]
        shapes = [(num_blocks, s.block_size, s.num_kv_heads, s.head_dim) for s in self.layer_specs]
        k = [_empty(shape, dtype, device, pin_memory) for shape in shapes[:self._num_slots]]
        v = [_empty(shape, dtype, device, pin_memory) for shape in shapes[:self._num_slots]]
        for t in k + v:
            t[0].zero_()
        self.k, self.v = self._by_layer(k), self._by_layer(v)
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        self._calibrated = [False] * len(shapes)
        if spec.is_quantized:
            kg, vg = quant.key_value_granularities(spec.scale_granularity)
            self.k_scale = self._scales(kg, shapes, device, pin_memory)
            self.v_scale = self._scales(vg, shapes, device, pin_memory)

    @property
    def _num_slots(self) -> int:
        return len(self.layer_specs) if self.layer_slots is None else max(self.layer_slots) + 1

    def _by_layer(self, per_slot: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each layer's tensor: its own, or its slot's (shared with the other groups' layer)."""
        return per_slot if self.layer_slots is None else [per_slot[s] for s in self.layer_slots]

    def _scales(self, gran: str, shapes: list, device: str, pin_memory: bool = False) -> list[torch.Tensor]:
        """Scale tensors per layer: per-token ones live with the pages (shared like them, pinned
        with them), static ones are each layer's own."""
        if gran == "per-token-head":
            scales = [self._scale_tensor(gran, shape, device) for shape in shapes[:self._num_slots]]
            return self._by_layer([pinned_empty(t.shape, t.dtype).copy_(t) for t in scales] if pin_memory else scales)
        return [self._scale_tensor(gran, shape, device) for shape in shapes]

    @property
    def num_layers(self) -> int:
        """Layers with pages: the target's, then the draft's if any."""
        return len(self.layer_specs)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one page holds across every layer (both models' with a draft)."""
        return pool_page_bytes(self.specs)

    def like(self, num_blocks: int, device: str = "cpu", pin_memory: bool = False) -> "KVCacheStorage":
        """An empty storage of the same layers with ``num_blocks`` pages (a tier's pool);
        ``pin_memory``: page-locked host memory of exactly its size (a GPU's tier:
        asynchronous PCIe copies; :mod:`~pagedkv.kv_cache.pinned`)."""
        return KVCacheStorage(self.spec, num_blocks, device, self.draft_spec, self.layer_slots, pin_memory)

    def draft_view(self) -> "LayerOffsetStorage":
        """The draft model's layers as a storage of their own (layer ``i`` is layer ``N + i``).

        Raises:
            ValueError: if this storage has no draft layers.
        """
        if self.draft_spec is None:
            raise ValueError("this KV storage has no draft-model layers")
        return LayerOffsetStorage(self, self.spec.num_layers)

    @staticmethod
    def _scale_tensor(gran: str, shape: tuple, device: str) -> torch.Tensor:
        """Ones in a granularity's scale shape: bfloat16 per token, fp32 static."""
        sshape = {"per-token-head": shape[:3], "per-head": (shape[2],), "per-tensor": (1,),
                  "per-channel": shape[2:]}[gran]
        dtype = torch.bfloat16 if gran == "per-token-head" else torch.float32
        return torch.ones(sshape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes held by all page and scale tensors
        (``spec.cache_bytes(num_blocks)`` for a pool of ``num_blocks`` usable pages:
        this storage holds ``num_pages = num_blocks + 1``, the null page included)."""
        unique = {id(t): t for t in self.k + self.v + self.k_scale + self.v_scale}  # shared slots once
        return sum(t.numel() * t.element_size() for t in unique.values())

    def page_tensors(self, layer: int) -> list[torch.Tensor]:
        """Every tensor of ``layer`` indexed by page (dim 0): K, V, and per-token-head scales
        if any (static scales are per layer, not per page). Moving a page moves these."""
        out = [self.k[layer], self.v[layer]]
        for scales in (self.k_scale, self.v_scale):
            if scales and scales[layer].dim() >= 3:  # per-token-head: [pages, block, heads]
                out.append(scales[layer])
        return out

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV (and per-token scales) of flat slots ``src`` ``[n]`` to ``dst`` ``[n]``
        in every layer, as bytes (KV eviction's compaction). They may share pages: every
        source is read before any destination is written."""
        unique = {id(t): t for layer in range(self.num_layers) for t in self.page_tensors(layer)}
        for t in unique.values():  # a shared slot's tensor once: a second pass would read moved slots
            flat = t.view(torch.uint8) if t.element_size() == 1 else t
            flat = flat.view(t.shape[0] * t.shape[1], -1)
            flat.index_copy_(0, dst, flat.index_select(0, src))

    def layer(self, layer: int) -> LayerKV:
        if not self.spec.is_quantized:
            return LayerKV(self.k[layer], self.v[layer], None, None)
        return LayerKV(self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer])

    def set_static_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fix a layer's per-head / per-tensor scales from sample keys and values
        ``[T, kv_heads, head_dim]`` (the engine calibrates at start: :mod:`pagedkv.worker.kv_scales`).
        A layer written before any call calibrates on its first write instead.

        Raises:
            ValueError: if this storage has no static scales (unquantized or per-token-head).
        """
        gran = self.spec.scale_granularity
        if not self.spec.is_quantized or gran == "per-token-head":
            raise ValueError(f"no static scales to set for {self.spec.dtype} / {gran}")
        for scales, x, g in zip((self.k_scale, self.v_scale), (k, v), quant.key_value_granularities(gran)):
            if g != "per-token-head":
                scales[layer].copy_(quant.compute_scales(x, self.spec.dtype, g))
        self._calibrated[layer] = True

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. ``slot_mapping`` ``[T]`` int64; ``k``, ``v`` ``[T, kv_heads, head_dim]``."""
        if self.spec.is_quantized:
            self._write_quantized(layer, slot_mapping, k, v)
            return
        flat = (-1, self.layer_specs[layer].num_kv_heads, self.layer_specs[layer].head_dim)
        self.k[layer].view(flat).index_copy_(0, slot_mapping, k.to(self.k[layer].dtype))
        self.v[layer].view(flat).index_copy_(0, slot_mapping, v.to(self.v[layer].dtype))

    def _write_quantized(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        spec = self.layer_specs[layer]
        flat = (-1, spec.num_kv_heads, spec.head_dim)
        kg, vg = quant.key_value_granularities(spec.scale_granularity)
        for pages, scales, x, gran in ((self.k, self.k_scale, k, kg), (self.v, self.v_scale, v, vg)):
            if gran == "per-token-head":
                s = quant.compute_scales(x, spec.dtype, gran)                 # [T, Hkv]
                scales[layer].view(-1, spec.num_kv_heads).index_copy_(0, slots, s.to(torch.bfloat16))  # exact
            elif not self._calibrated[layer]:
                scales[layer].copy_(quant.compute_scales(x, spec.dtype, gran))
            view = quant.scale_view(s if gran == "per-token-head" else scales[layer], gran)
            q = quant.quantize(x, view, spec.dtype)
            # index_copy_ has no fp8 kernel on CPU: move the bytes as uint8
            pages[layer].view(torch.uint8).view(flat).index_copy_(0, slots, q.view(torch.uint8))
        self._calibrated[layer] = True


class LayerOffsetStorage:
    """Layers ``offset ..`` of a :class:`KVCacheStorage`, seen as layers ``0 ..``: what a
    draft model's forward writes and reads (its pages are the target's page ids)."""

    def __init__(self, storage: KVCacheStorage, offset: int) -> None:
        self.storage, self.offset = storage, offset

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.storage.write(layer + self.offset, slot_mapping, k, v)

    def layer(self, layer: int) -> LayerKV:
        return self.storage.layer(layer + self.offset)

    def set_static_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.storage.set_static_scales(layer + self.offset, k, v)
