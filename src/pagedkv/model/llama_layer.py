"""LlamaLayer: one decoder layer's fused weights and its forward over paged KV.

RMSNorm -> fused QKV projection -> RoPE -> write K/V to pages through the slot mapping ->
paged attention (reads through block tables) -> output projection -> residual; RMSNorm ->
gated MLP (fused gate/up) -> residual (Gemma 2: a norm on each sublayer's output too).
Two ways through it: :meth:`LlamaLayer.forward` op by op, or :meth:`LlamaLayer.forward_fused`
as one call of the kernel library (:class:`~pagedkv.model.llama.LlamaModel` chooses).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pagedkv.attention.dispatch import paged_attention
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.kv_cache.storage import KVCacheStorage
from pagedkv.model.config import ModelConfig
from pagedkv.model.ggml_a8 import GGMLA8Weight
from pagedkv.model.ggml_weights import GGMLWeight
from pagedkv.model.int8_weights import Int8Weight, kernel_op
from pagedkv.model.layer_ops import ACTIVATIONS, fuse, op_weight, rms_norm
from pagedkv.model.rope import RotaryEmbedding


class LlamaLayer:
    """One decoder layer's weights (fused) and forward.

    Args:
        cfg: the model's config.
        w: the state dict; this layer's tensors are popped from it (freeing memory as it goes).
        prefix: the layer's name in ``w`` (``model.layers.<i>``).
        window: sliding window in tokens (0 or None: full attention).
        sinks: with a window, leading positions every query also sees (streaming eviction).
        linear: the product ``linear(x, weight, bias)`` (torch's, or the batch-invariant one:
            :func:`pagedkv.numerics.linear_for`).
        all_reduce: tensor parallelism: sums a row-parallel output over the ranks, in place
            (None on one rank).
    """

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, window: int | None = None,
                 sinks: int = 0, linear: Callable = F.linear, all_reduce: Callable | None = None) -> None:
        get = lambda n: w.pop(f"{prefix}.{n}")  # noqa: E731 - frees memory as it goes
        self.cfg = cfg
        self.window = int(window or 0)
        self.sinks = sinks if self.window else 0
        self.linear = linear
        self.all_reduce = all_reduce
        self.in_norm, self.post_norm = get("input_layernorm.weight"), get("post_attention_layernorm.weight")
        # Gemma 2: post_norm norms the attention output; these norm the MLP's input and output
        self.pre_ff_norm = get("pre_feedforward_layernorm.weight") if cfg.sandwich_norms else None
        self.post_ff_norm = get("post_feedforward_layernorm.weight") if cfg.sandwich_norms else None
        self.act = ACTIVATIONS[cfg.hidden_act]
        # Gemma 3, Qwen 3: q and k RMS-normed per head (over head_dim) before RoPE
        self.q_norm = get("self_attn.q_norm.weight") if cfg.qk_norm else None
        self.k_norm = get("self_attn.k_norm.weight") if cfg.qk_norm else None
        self.qkv = fuse([get(f"self_attn.{p}_proj.weight") for p in "qkv"])  # [(H + 2 Hkv) * D, hidden]
        self.qkv_bias = (torch.cat([get(f"self_attn.{p}_proj.bias") for p in "qkv"])
                         if f"{prefix}.self_attn.q_proj.bias" in w else None)
        self.o = get("self_attn.o_proj.weight")
        self.gate_up = fuse([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
        self.down = get("mlp.down_proj.weight")
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim

    def forward(self, x: torch.Tensor, idx: int, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCacheStorage, meta: AttentionMetadata, rope_cos_sin=None, sink_cos_sin=None,
                observer=None) -> torch.Tensor:
        """``sink_cos_sin`` (:meth:`LlamaModel.sink_cos_sin`, or None): the rotation from each
        row's position to its position within the cache, for the queries that score the sinks.
        ``observer(idx, q, pages)``, if given, sees the queries once this step's KV is written."""
        cfg = self.cfg
        q, k, v = self.project(x, positions, rope, rope_cos_sin)
        kv_cache.write(idx, meta.slot_mapping, k, v)
        pages = kv_cache.layer(idx)
        if observer is not None:
            observer(idx, q, pages)
        attn = paged_attention(q, pages.k, pages.v, meta, cfg.attention_scale, pages.k_scale, pages.v_scale,
                               self.window, self.sinks, self.sink_queries(q, sink_cos_sin),
                               cfg.attn_logit_softcapping or 0.0)
        return self.finish(x, attn)

    def sink_queries(self, q: torch.Tensor, sink_cos_sin) -> torch.Tensor | None:
        """``q`` ``[T, H, D]`` (rotated) rotated again by ``sink_cos_sin``: what scores this
        layer's attention sinks; None without sinks or rope_cos_sin."""
        if sink_cos_sin is None or not self.sinks:
            return None
        return RotaryEmbedding.rotate_(q.clone(memory_format=torch.contiguous_format), *sink_cos_sin)

    def forward_fused(self, op, x: torch.Tensor, idx: int, rope_cos_sin, kv_cache: KVCacheStorage,
                      meta: AttentionMetadata, sink_cos_sin=None) -> torch.Tensor:
        """:meth:`forward` as one call of the kernel library's ``decoder_layer`` (GGML or
        int8 weights, unquantized pages; see :meth:`LlamaModel.fused_op`): bit-identical, less Python."""
        cfg, pages = self.cfg, kv_cache.layer(idx)
        seq_info, block_tables = meta.packed
        sink_cos, sink_sin = sink_cos_sin if sink_cos_sin is not None and self.sinks else (None, None)
        return op(x, self.in_norm, self.post_norm, cfg.rms_norm_eps, *op_weight(self.qkv), *op_weight(self.o),
                  *op_weight(self.gate_up), *op_weight(self.down), rope_cos_sin[0], rope_cos_sin[1],
                  cfg.num_attention_heads,
                  cfg.num_key_value_heads, cfg.head_dim, pages.k, pages.v, meta.slot_mapping, seq_info, block_tables,
                  cfg.attention_scale, self.window, self.sinks, sink_cos, sink_sin)

    def fusable(self) -> bool:
        """Whether :meth:`forward_fused` covers this layer's weights (int8-activation ones
        only where their kernel is built)."""
        weights = (self.qkv, self.o, self.gate_up, self.down)
        if any(isinstance(w, GGMLA8Weight) for w in weights) and kernel_op("ggml_a8_linear") is None:
            return False
        cfg = self.cfg
        if cfg.sandwich_norms or cfg.hidden_act != "silu" or cfg.attn_logit_softcapping or cfg.qk_norm:
            return False  # the one-call layer is Llama's
        if self.all_reduce is not None:
            return False  # its products are partial sums: the all-reduce runs between them
        return (self.qkv_bias is None and self.in_norm.dtype == torch.float32
                and all(isinstance(w, (GGMLWeight, GGMLA8Weight, Int8Weight)) for w in weights))

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                rope_cos_sin=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention inputs of ``x`` ``[T, hidden]``: q ``[T, H, D]`` and k, v ``[T, Hkv, D]``
        (RoPE applied to q and k, in one pass; ``rope_cos_sin`` = ``rope.cos_sin(positions)`` if
        the caller looked them up already)."""
        cfg, T = self.cfg, x.shape[0]
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = rms_norm(x, self.in_norm, cfg.rms_norm_eps)
        qkv = self.linear(h, self.qkv, self.qkv_bias)
        cos, sin = rope_cos_sin if rope_cos_sin is not None else rope.cos_sin(positions)
        qk = qkv[:, :self.q_size + self.kv_size].view(T, H + Hkv, D)
        if self.q_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :H].contiguous(), self.q_norm, cfg.rms_norm_eps),
                            rms_norm(qk[:, H:].contiguous(), self.k_norm, cfg.rms_norm_eps)], dim=1)
        qk = rope.rotate_(qk, cos, sin).to(qkv.dtype)  # (rotated in float32 where x is not: cast back)
        return qk[:, :H], qk[:, H:], qkv[:, self.q_size + self.kv_size:].view(T, Hkv, D)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input ``x`` and attention output ``attn`` ``[T, H, D]``."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        o = self.reduced(self.linear(attn.reshape(x.shape[0], self.q_size), self.o))
        if cfg.sandwich_norms:  # Gemma 2: norm each sublayer's output before its residual add
            x = x + rms_norm(o, self.post_norm, eps)
            mlp = self.linear(self.act(self.linear(rms_norm(x, self.pre_ff_norm, eps), self.gate_up)), self.down)
            return x + rms_norm(self.reduced(mlp), self.post_ff_norm, eps)
        x = x + o
        h = rms_norm(x, self.post_norm, eps)
        return x + self.reduced(self.linear(self.act(self.linear(h, self.gate_up)), self.down))

    def reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel product's output summed over the tensor-parallel ranks (in place;
        :mod:`pagedkv.model.partition`), or as it is on one rank."""
        if self.all_reduce is not None:
            self.all_reduce(partial)
        return partial
