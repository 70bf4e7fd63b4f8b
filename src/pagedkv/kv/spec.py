"""KVCacheSpec: the memory arithmetic of a KV cache, shared by engine, planner and simulator.

A page (block) holds ``block_size`` token slots of K and V for every layer. The
engine sizes its block pool with :meth:`KVCacheSpec.num_blocks_for`; the planner
prints the same numbers. Nothing here imports torch: sizes are plain ints.

Per layer and token a standard (MHA/GQA/MQA) layer stores
``num_kv_heads * (head_dim + v_head_dim)`` elements; an MLA layer (DeepSeek-V2/V3,
arXiv:2405.04434 section 2.1) stores one latent of ``kv_lora_rank +
qk_rope_head_dim`` elements shared by all heads. Quantized dtypes add the bytes
of their scales (see :data:`SCALE_GRANULARITIES`).

Units: ``*_bytes`` are bytes; token counts are tokens; block counts are blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Storage bytes per element of each KV dtype. int4 packs two elements per byte.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "float16": 2, "bfloat16": 2,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "int4": 0.5,
}
QUANTIZED_DTYPES = frozenset({"fp8_e4m3", "fp8_e5m2", "int8", "int4"})
#: How quantized pages store their scales:
#: per-tensor: one fp32 per layer for K and one for V; per-head: one fp32 per layer, KV head
#: and K/V; per-token-head: one bfloat16 per token, KV head and K/V (with the page; bfloat16
#: keeps fp32's range, and the scale is rounded up so no value saturates: see kv_cache/quant.py).
#: 2-byte token scales are what lets int8 reach 1.94x float16's tokens per byte at head_dim 64
#: (fp32 scales: 1.88x); llama.cpp's Q8_0 likewise keeps a 2-byte scale per 32 values.
#: per-channel (KIVI-style, Liu et al. 2024, arXiv:2402.02750): keys get one static fp32
#: scale per KV head and channel (key outliers sit in fixed channels), values one bfloat16
#: scale per token and KV head; MLA latents get one static scale per latent channel.
SCALE_GRANULARITIES = ("per-tensor", "per-head", "per-token-head", "per-channel")
TOKEN_SCALE_BYTES = 2   # bfloat16, per token and KV head
STATIC_SCALE_BYTES = 4  # float32, per layer (and KV head)
NULL_PAGES = 1          # page 0 of every pool: the null block


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one model's KV cache.

    Attributes:
        num_layers: decoder layers holding a cache.
        num_kv_heads: KV heads per layer (MHA: = query heads; MQA: 1; ignored for MLA).
        head_dim: key head dimension (the config's ``head_dim``, else hidden/heads).
        dtype: storage dtype name, a key of :data:`DTYPE_BYTES`.
        block_size: token slots per page.
        v_head_dim: value head dimension; ``None`` means ``head_dim``.
        mla_latent_dim: ``kv_lora_rank + qk_rope_head_dim`` for MLA layers; 0 for K/V heads.
        layer_windows: per layer, the sliding-window length in tokens or ``None`` for
            full attention; empty means every layer is full.
        scale_granularity: for quantized dtypes, one of :data:`SCALE_GRANULARITIES`.
        page_layers: layers whose block one page holds; 0 = every layer. A hybrid cache whose
            KV groups share page tensors (:func:`pagedkv.kv.groups.shared_page_slots`) holds
            one group's layers per page: ``num_layers / number of groups``.
        page_windows: whether window layers give their pages back as their windows slide
            (the engine keeps window KV groups); False where one full-attention group holds
            every layer's pages for every token (a draft model, the offload tiers, layers of
            several windows): only what is held changes, not what attention reads.

    Raises:
        ValueError: on a non-positive size, unknown dtype or granularity, or a
            ``layer_windows`` whose length is not ``num_layers``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    block_size: int = 16
    v_head_dim: int | None = None
    mla_latent_dim: int = 0
    layer_windows: tuple[int | None, ...] = field(default=())
    scale_granularity: str = "per-token-head"
    page_layers: int = 0
    page_windows: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV cache dtype {self.dtype!r}; choose from {sorted(DTYPE_BYTES)}")
        if self.scale_granularity not in SCALE_GRANULARITIES:
            raise ValueError(f"unknown scale granularity {self.scale_granularity!r}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries, need {self.num_layers}")
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError("sliding windows must be positive")
        if not 0 <= self.page_layers <= self.num_layers:
            raise ValueError(f"page_layers must be in 0..{self.num_layers}, got {self.page_layers}")

    # ---- per token --------------------------------------------------------------
    @property
    def dtype_bytes(self) -> float:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def elements_per_token_layer(self) -> int:
        """K and V elements one token stores in one layer."""
        if self.mla_latent_dim:
            return self.mla_latent_dim
        return self.num_kv_heads * (self.head_dim + (self.v_head_dim or self.head_dim))

    @property
    def scale_bytes_per_token_layer(self) -> int:
        """Bytes of per-token scales in one layer (per-token-head: K and V; per-channel: V)."""
        if not self.is_quantized or self.scale_granularity not in ("per-token-head", "per-channel"):
            return 0
        if self.scale_granularity == "per-channel":
            return 0 if self.mla_latent_dim else self.num_kv_heads * TOKEN_SCALE_BYTES
        heads = 1 if self.mla_latent_dim else self.num_kv_heads
        parts = 1 if self.mla_latent_dim else 2  # K and V
        return heads * parts * TOKEN_SCALE_BYTES

    @property
    def scale_bytes_per_layer(self) -> int:
        """Bytes of static (per-tensor, per-head, per-channel keys) scales in one layer."""
        if not self.is_quantized or self.scale_granularity == "per-token-head":
            return 0
        if self.scale_granularity == "per-channel":
            return (self.mla_latent_dim or self.num_kv_heads * self.head_dim) * STATIC_SCALE_BYTES
        heads = 1 if (self.mla_latent_dim or self.scale_granularity == "per-tensor") else self.num_kv_heads
        return heads * (1 if self.mla_latent_dim else 2) * STATIC_SCALE_BYTES

    @property
    def bytes_per_token_layer(self) -> int:
        """Bytes one token occupies in one layer's pages, scales included."""
        return math.ceil(self.elements_per_token_layer * self.dtype_bytes) + self.scale_bytes_per_token_layer

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers (no window cap)."""
        return self.bytes_per_token_layer * self.num_layers

    # ---- per page -----------------------------------------------------------------
    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page: a block of every layer (``block_size * bytes_per_token``), or of
        ``page_layers`` layers where groups share page tensors."""
        return self.block_size * self.bytes_per_token_layer * (self.page_layers or self.num_layers)

    @property
    def static_bytes(self) -> int:
        """Bytes held once per cache regardless of blocks (static scales)."""
        return self.scale_bytes_per_layer * self.num_layers

    def num_blocks_for(self, budget_bytes: int) -> int:
        """Usable blocks that fit in ``budget_bytes`` (the engine's pool size for that
        budget): the budget also holds the static scales and the null page (page 0, which
        block-table entries of freed pages point at; :mod:`pagedkv.kv.block_pool`).

        Raises:
            ValueError: if not even one block fits beside the null page.
        """
        return pool_num_blocks((self,), budget_bytes)

    def cache_bytes(self, num_blocks: int) -> int:
        """Bytes a pool of ``num_blocks`` usable blocks allocates: pages (null page
        included) and static scales."""
        return pool_cache_bytes((self,), num_blocks)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds (full attention)."""
        return -(-int(num_tokens) // self.block_size)

    # ---- sequences, with sliding windows ---------------------------------------------
    def tokens_held(self, num_tokens: int, layer: int) -> int:
        """Tokens layer ``layer`` must keep for a sequence of ``num_tokens`` (window cap)."""
        w = self.layer_windows[layer] if self.layer_windows else None
        return num_tokens if w is None else min(num_tokens, w)

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Exact bytes one sequence of ``num_tokens`` needs (windows capped, no rounding)."""
        return sum(self.tokens_held(num_tokens, i) * self.bytes_per_token_layer
                   for i in range(self.num_layers))

    def paged_bytes_for_tokens(self, num_tokens: int) -> int:
        """Bytes a paged engine holds for ``num_tokens``: each layer rounds up to whole
        blocks; a window layer holds at most ``ceil(window / block_size) + 1`` blocks,
        since a window that does not start on a block boundary straddles one more (with
        ``page_windows``; else every block)."""
        total = 0
        for i in range(self.num_layers):
            w = self.layer_windows[i] if self.layer_windows and self.page_windows else None
            blocks = self.blocks_for_tokens(num_tokens)
            if w is not None:
                blocks = min(blocks, self.blocks_for_tokens(w) + 1)
            total += blocks * self.block_size * self.bytes_per_token_layer
        return total


# ---- one pool, several models' layers (a target and its draft model) -------------------------
def check_pool_specs(specs: tuple[KVCacheSpec, ...]) -> None:
    """Several models' caches share one pool's page ids only with one block size, dtype and
    scale granularity. Raises ValueError naming the difference."""
    for name in ("block_size", "dtype", "scale_granularity"):
        values = {getattr(s, name) for s in specs}
        if len(values) > 1:
            raise ValueError(f"KV caches sharing one pool need one {name}, got {sorted(map(str, values))}")


def pool_page_bytes(specs: tuple[KVCacheSpec, ...]) -> int:
    """Bytes of one page when it holds a block of every spec's layers (a target's and its
    draft model's: speculative decoding keeps both caches in one pool)."""
    return sum(s.page_size_bytes for s in specs)


def pool_num_blocks(specs: tuple[KVCacheSpec, ...], budget_bytes: int) -> int:
    """Usable pages of ``pool_page_bytes(specs)`` in ``budget_bytes``, beside the static
    scales and the null page. Raises ValueError if not even one fits."""
    page = pool_page_bytes(specs)
    n = (int(budget_bytes) - sum(s.static_bytes for s in specs)) // page - NULL_PAGES
    if n < 1:
        raise ValueError(f"KV cache budget of {int(budget_bytes)} bytes holds no block of "
                         f"{page} bytes beside the null page (block_size={specs[0].block_size})")
    return n


def pool_cache_bytes(specs: tuple[KVCacheSpec, ...], num_blocks: int) -> int:
    """Bytes a pool of ``num_blocks`` usable pages of every spec's layers allocates."""
    return (num_blocks + NULL_PAGES) * pool_page_bytes(specs) + sum(s.static_bytes for s in specs)
