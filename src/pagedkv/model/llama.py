"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM, Gemma 2/3) over a paged KV cache.

Per layer: RMSNorm -> fused QKV projection -> RoPE -> write K/V to pages through the
slot mapping -> paged attention (reads through block tables) -> output projection ->
residual; RMSNorm -> SwiGLU MLP (fused gate/up) -> residual. Tokens of all sequences in
a step are flattened into one ``[T, hidden]`` batch (prefill chunks and decodes mixed).
Computes in fp32; the KV storage dtype is the cache's own.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from pagedkv.attention.dispatch import layer_op, paged_attention
from pagedkv.attention.kernel import kernel_supports
from pagedkv.attention.paged import AttentionMetadata, attend
from pagedkv.kv.storage import KVCacheStorage
from pagedkv.model.config import ModelConfig
from pagedkv.model.int8_weights import Int8Weight, kernel_op, weight_bytes
from pagedkv.model.ggml_a8 import GGMLA8Weight
from pagedkv.model.ggml_weights import GGMLWeight
from pagedkv.model.weight_formats import EMBED, WEIGHT_DTYPES, lm_head_for, prepare_state
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.numerics import linear_for


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (Zhang & Sennrich, 2019):
    the kernel library's one-call op (``csrc/layer_ops.cpp``), else torch's."""
    op = layer_op("rms_norm")
    if op is not None and x.dtype == torch.float32 and x.is_contiguous():
        return op(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[T, 2I]`` (gate first) -> ``[T, I]`` (SwiGLU)."""
    op = layer_op("silu_and_mul")
    if op is not None and gate_up.dtype == torch.float32 and gate_up.is_contiguous():
        return op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU with the tanh approximation: Gemma's
    ``gelu_pytorch_tanh``) of ``gate_up`` ``[T, 2I]`` -> ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


#: the gated MLP's activation by config name (``hidden_act``)
ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


def fuse(parts: list):
    """Row-wise concatenation of a layer's weights (q/k/v, gate/up): tensors, or GGML blocks."""
    if all(isinstance(p, GGMLWeight) for p in parts):
        return GGMLWeight.concat(parts)
    return torch.cat(parts).contiguous()


A8 = 256  # decoder_layer's flag on a ggml type: the weight multiplies int8 activations


def _op_weight(w) -> tuple:
    """A quantized weight as ``decoder_layer`` takes it: (values, scale or None, ggml type,
    plus ``A8`` for :class:`GGMLA8Weight`)."""
    if isinstance(w, Int8Weight):
        return w.q, w.scale, 0
    return w.packed, None, w.qtype | (A8 if isinstance(w, GGMLA8Weight) else 0)


def _gemma_norms(w: dict, num_layers: int) -> None:
    """Gemma's RMSNorm scales by ``1 + weight`` (HF ``GemmaRMSNorm``): store ``1 + weight``
    in fp32 so every norm here is the same ``x * rsqrt(mean(x^2) + eps) * w``."""
    names = ["model.norm.weight"] + [f"model.layers.{i}.{n}_layernorm.weight" for i in range(num_layers)
                                     for n in ("input", "post_attention", "pre_feedforward", "post_feedforward")]
    names += [f"model.layers.{i}.self_attn.{n}_norm.weight" for i in range(num_layers) for n in "qk"]  # Gemma 3
    for name in names:
        if name in w:
            w[name] = 1.0 + w[name].to(torch.float32)


class LlamaLayer:
    """One decoder layer's weights (fused) and forward."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, window: int | None = None) -> None:
        get = lambda n: w.pop(f"{prefix}.{n}")  # noqa: E731 - frees memory as it goes
        self.cfg = cfg
        self.window = int(window or 0)  # sliding window in tokens (0: full attention)
        self.sinks = 0  # with a window: leading positions every query also sees (streaming eviction)
        self.linear = F.linear  # or numerics.invariant_linear (LlamaModel.set_batch_invariant)
        self.all_reduce = None  # tensor parallelism: sums a row-parallel output over the ranks, in place
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
                kv: KVCacheStorage, meta: AttentionMetadata, tables=None, sink_tables=None,
                observer=None) -> torch.Tensor:
        """``sink_tables`` (:meth:`LlamaModel.sink_tables`, or None): the rotation from each
        row's position to its position within the cache, for the queries that score the sinks.
        ``observer(idx, q, pages)``, if given, sees the queries once this step's KV is written."""
        cfg = self.cfg
        q, k, v = self.project(x, positions, rope, tables)
        kv.write(idx, meta.slot_mapping, k, v)
        pages = kv.layer(idx)
        if observer is not None:
            observer(idx, q, pages)
        attn = paged_attention(q, pages.k, pages.v, meta, cfg.attention_scale, pages.k_scale, pages.v_scale,
                               self.window, self.sinks, self.sink_queries(q, sink_tables),
                               cfg.attn_logit_softcapping or 0.0)
        return self.finish(x, attn)

    def sink_queries(self, q: torch.Tensor, sink_tables) -> torch.Tensor | None:
        """``q`` ``[T, H, D]`` (rotated) rotated again by ``sink_tables``: what scores this
        layer's attention sinks; None without sinks or tables."""
        if sink_tables is None or not self.sinks:
            return None
        return RotaryEmbedding.rotate_(q.clone(memory_format=torch.contiguous_format), *sink_tables)

    def forward_fused(self, op, x: torch.Tensor, idx: int, tables, kv: KVCacheStorage,
                      meta: AttentionMetadata, sink_tables=None) -> torch.Tensor:
        """:meth:`forward` as one call of the kernel library's ``decoder_layer`` (GGML or
        int8 weights, unquantized pages; see :meth:`LlamaModel.fused_op`): bit-identical, less Python."""
        cfg, pages = self.cfg, kv.layer(idx)
        seq_info, block_tables = meta.packed
        sink_cos, sink_sin = sink_tables if sink_tables is not None and self.sinks else (None, None)
        return op(x, self.in_norm, self.post_norm, cfg.rms_norm_eps, *_op_weight(self.qkv), *_op_weight(self.o),
                  *_op_weight(self.gate_up), *_op_weight(self.down), tables[0], tables[1], cfg.num_attention_heads,
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
                tables=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention inputs of ``x`` ``[T, hidden]``: q ``[T, H, D]`` and k, v ``[T, Hkv, D]``
        (RoPE applied to q and k, in one pass; ``tables`` = ``rope.tables(positions)`` if
        the caller looked them up already)."""
        cfg, T = self.cfg, x.shape[0]
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = rms_norm(x, self.in_norm, cfg.rms_norm_eps)
        qkv = self.linear(h, self.qkv, self.qkv_bias)
        cos, sin = tables if tables is not None else rope.tables(positions)
        qk = qkv[:, :self.q_size + self.kv_size].view(T, H + Hkv, D)
        if self.q_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :H].contiguous(), self.q_norm, cfg.rms_norm_eps),
                            rms_norm(qk[:, H:].contiguous(), self.k_norm, cfg.rms_norm_eps)], dim=1)
        qk = rope.rotate_(qk, cos, sin)
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


class LlamaModel:
    """Embeddings, decoder layers, final norm and LM head, built from an HF state dict.

    ``quantized``: the checkpoint's own GGML blocks by HF tensor name
    (:func:`pagedkv.model.gguf_convert.read_blocks`), which ``weight_dtype`` ``auto`` and
    ``int4`` keep (:mod:`pagedkv.model.weight_formats`); ``state`` may then leave those
    tensors out (the fp32 embedding table is always needed for row lookups).

    Raises:
        KeyError: if a tensor the config implies is missing from ``state``.
    """

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], batch_invariant: bool = False,
                 weight_dtype: str = "float32", quantized: dict | None = None) -> None:
        w = dict(state)
        self.cfg = cfg
        if weight_dtype in ("auto", "int4"):
            w.update({k: v for k, v in (quantized or {}).items() if k != EMBED})
            prepare_state(w, weight_dtype, cfg.num_hidden_layers)
        self.embed = w.pop("model.embed_tokens.weight")         # [vocab, hidden]
        if cfg.model_type.startswith("gemma"):
            _gemma_norms(w, cfg.num_hidden_layers)
        windows = cfg.layer_windows or (None,) * cfg.num_hidden_layers
        self.layers = [LlamaLayer(cfg, w, f"model.layers.{i}", windows[i]) for i in range(cfg.num_hidden_layers)]
        self.norm = w.pop("model.norm.weight")
        self.lm_head = w.pop("lm_head.weight", None)
        if self.lm_head is None or cfg.tie_word_embeddings:
            self.lm_head = self.embed
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        local = (None if cfg.local_rope_theta is None else
                 RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta, cfg.local_rope_scaling))
        #: per layer, its RoPE (Gemma 3's window layers have their own)
        self.layer_ropes = [local if local is not None and layer.window else self.rope for layer in self.layers]
        self._ropes = list({id(r): r for r in self.layer_ropes}.values())  # each once: tables looked up per forward
        self.weight_dtype = weight_dtype
        self.fused_layers = True  # use the one-call decoder_layer op where it applies (fused_op)
        self.fused_stack = True  # and then every layer in one decoder_stack call where that applies (stack_op)
        self._stack_args: tuple | None = None  # decoder_stack's per-layer lists, made once per KV storage
        # streaming's positions within the cache (sinks + window tokens), or None: original positions
        self.streaming_cache_len: int | None = None
        if weight_dtype == "int8":
            self._quantize_int8()
        elif weight_dtype in ("auto", "int4"):
            tied = self.lm_head is self.embed
            self.lm_head = lm_head_for(self.lm_head, (quantized or {}).get(EMBED), tied, weight_dtype)
        elif weight_dtype != "float32":
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        self._fusable: bool | None = None
        self._pages_checked, self._pages_ok = None, False  # the pages fused_op last looked at
        self.set_batch_invariant(batch_invariant)

    def _quantize_int8(self) -> None:
        """Every linear weight (the LM head too, apart from the embedding table it may share,
        which stays fp32 for row lookups) as :class:`Int8Weight`. The fp32 tensors kept are
        copied out of the checkpoint: a view into the memory-mapped file would keep all of
        it resident, fp32 weights included."""
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, Int8Weight.quantize(getattr(layer, name)))
            layer.in_norm, layer.post_norm = layer.in_norm.clone(), layer.post_norm.clone()
            if layer.q_norm is not None:
                layer.q_norm, layer.k_norm = layer.q_norm.clone(), layer.k_norm.clone()
            if layer.qkv_bias is not None:
                layer.qkv_bias = layer.qkv_bias.clone()
        self.lm_head = Int8Weight.quantize(self.lm_head)
        self.embed, self.norm = self.embed.clone(), self.norm.clone()

    def set_batch_invariant(self, on: bool) -> None:
        """Compute every linear layer (LM head included) in fixed row tiles, so each row's
        bits do not depend on the batch (see :mod:`pagedkv.numerics`), or with torch's own."""
        self.batch_invariant = bool(on)
        self.linear = linear_for(self.batch_invariant)
        for layer in self.layers:
            layer.linear = self.linear

    def set_all_reduce(self, fn) -> None:
        """Tensor parallelism: ``fn(t)`` sums ``t`` over the ranks in place after every
        row-parallel product (output projection, MLP down); the one-call layer ops, which do
        not stop between those products, are then not used."""
        for layer in self.layers:
            layer.all_reduce = fn
        self._fusable = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCacheStorage,
                meta: AttentionMetadata | Sequence[AttentionMetadata], kv_hooks=None,
                observer=None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; ``input_ids``/``positions`` ``[T]``;
        ``observer``: see :meth:`LlamaLayer.forward` (it takes the per-op path).

        ``meta``: one attention metadata for every layer, or one per layer (layers of
        different KV cache groups read different block tables). ``kv_hooks`` (a KV
        connector's worker side, or None): ``wait_for_layer_load(i)`` before layer ``i``
        reads its pages, ``save_kv_layer(i, kv, meta_i)`` after it wrote them.
        """
        metas = meta if isinstance(meta, (list, tuple)) else [meta] * len(self.layers)
        x = self.embed_rows(input_ids)
        per_rope = {id(r): (r.tables(positions), self.sink_tables(positions, r)) for r in self._ropes}
        tables, sink_tables = per_rope[id(self.layer_ropes[0])]  # every layer's, where the stack runs
        fused = self.fused_op(kv) if observer is None else None
        stack = self.stack_op(fused, metas, kv_hooks)
        if stack is not None:
            return self.final_norm(self._forward_stack(stack, x, tables, sink_tables, kv, metas[0]))
        for i, layer in enumerate(self.layers):
            if kv_hooks is not None:
                kv_hooks.wait_for_layer_load(i)
            tables, sink_tables = per_rope[id(self.layer_ropes[i])]
            if fused is not None:
                x = layer.forward_fused(fused, x, i, tables, kv, metas[i], sink_tables)
            else:
                x = layer.forward(x, i, positions, self.layer_ropes[i], kv, metas[i], tables, sink_tables, observer)
            if kv_hooks is not None:
                kv_hooks.save_kv_layer(i, kv, metas[i])
        return self.final_norm(x)

    def stack_op(self, fused, metas, kv_hooks):
        """``torch.ops.pagedkv.decoder_stack`` (every layer in one call) where the one-call
        layer applies (``fused``), ``fused_stack`` is on, there is no KV connector to call
        between layers, every layer reads the same block tables (one KV cache group) and every
        layer has the same sinks; else None (the layers then run one call each)."""
        if fused is None or not self.fused_stack or kv_hooks is not None:
            return None
        if any(m is not metas[0] for m in metas) or len({layer.sinks for layer in self.layers}) != 1:
            return None
        return layer_op("decoder_stack")

    def _forward_stack(self, op, x, tables, sink_tables, kv: KVCacheStorage, meta: AttentionMetadata):
        pages = kv.layer(0).k
        if self._stack_args is None or self._stack_args[0] is not pages:  # once per storage
            weights, scales, types = [], [], []
            for layer in self.layers:
                for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
                    values, scale, qtype = _op_weight(w)
                    weights.append(values)
                    scales.append(scale)
                    types.append(qtype)
            layers = [kv.layer(i) for i in range(len(self.layers))]
            self._stack_args = (pages, [layer.in_norm for layer in self.layers],
                                [layer.post_norm for layer in self.layers], weights, scales, types,
                                [p.k for p in layers], [p.v for p in layers])
        _, in_norms, post_norms, weights, scales, types, k_pages, v_pages = self._stack_args
        cfg, first = self.cfg, self.layers[0]
        seq_info, block_tables = meta.packed
        sink_cos, sink_sin = sink_tables if sink_tables is not None and first.sinks else (None, None)
        return op(x, in_norms, post_norms, cfg.rms_norm_eps, weights, scales, types, tables[0], tables[1],
                  cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, k_pages, v_pages,
                  meta.slot_mapping, seq_info, block_tables, cfg.attention_scale,
                  [layer.window for layer in self.layers], first.sinks, sink_cos, sink_sin)

    @torch.inference_mode()
    def dense_forward(self, token_ids: list[int], on_kv=None) -> torch.Tensor:
        """``token_ids`` through every layer without pages (fp32 activations, each layer's
        attention over the fp32 k/v it just made, window and sinks applied): the normed hidden
        states ``[T, hidden]``. ``on_kv(i, k, v)`` sees each layer's k, v ``[T, Hkv, D]``.
        The calibrations' forward (static KV scales, W8A8 smoothing)."""
        x = self.embed_rows(torch.tensor(token_ids))
        positions = torch.arange(len(token_ids))
        for i, layer in enumerate(self.layers):
            sink_tables = self.sink_tables(positions, self.layer_ropes[i])
            q, k, v = layer.project(x, positions, self.layer_ropes[i])
            if on_kv is not None:
                on_kv(i, k, v)
            attn = attend(q, k, v, self.cfg.attention_scale, layer.window, layer.sinks,
                          layer.sink_queries(q, sink_tables), self.cfg.attn_logit_softcapping or 0.0)
            x = layer.finish(x, attn)
        return self.final_norm(x)

    def sink_tables(self, positions: torch.Tensor, rope: RotaryEmbedding | None = None):
        """Streaming's positions within the cache (StreamingLLM, Xiao et al. 2023, sec. 3.2):
        with ``streaming_cache_len`` C = sinks + window, the row at position p sits at cache
        position min(p, C - 1) and the sinks at 0..S-1, so a sink key is scored by q rotated
        back by p - (C - 1) (window keys keep their distance p - j: RoPE scores depend on it
        alone, so their stored keys need no re-rotation). Returns that rotation's (cos, sin)
        tables ``[T, 1, D]`` (identity where p < C), or None when no row needs one; ``rope``:
        the layer's RoPE (default: the full layers')."""
        if self.streaming_cache_len is None or not positions.numel():
            return None
        back = (positions - (self.streaming_cache_len - 1)).clamp_(min=0)
        if not bool(back.any()):
            return None
        cos, sin = (rope or self.rope).tables(back)
        return cos, -sin

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output ``[T, hidden]`` normed as the LM head takes it."""
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def fused_op(self, kv):
        """``torch.ops.pagedkv.decoder_layer`` where it computes this forward exactly as the
        per-op path would: the kernel library loads and ``PAGEDKV_ATTENTION`` uses it, every
        layer has GGML or int8 weights and no bias, and the pages are unquantized (fp32/fp16/bf16) in
        a shape the attention kernel covers. Else None (and with ``fused_layers`` off)."""
        if not self.fused_layers:
            return None
        op = layer_op("decoder_layer")
        if op is None:
            return None
        if self._fusable is None:  # (the one-call layers take one RoPE table for every layer)
            self._fusable = all(layer.fusable() for layer in self.layers) and len(set(map(id, self.layer_ropes))) == 1
        if not self._fusable:
            return None
        pages = kv.layer(0)
        if self._pages_checked is not pages.k:  # once per storage, not per forward
            q = torch.empty(0, self.cfg.num_attention_heads, self.cfg.head_dim)
            self._pages_checked = pages.k
            self._pages_ok = pages.k_scale is None and kernel_supports(q, pages.k, pages.v)
        return op if self._pages_ok else None

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings ``[T, hidden]`` of ``input_ids`` ``[T]``, times the config's
        ``embedding_multiplier`` (Gemma: ``sqrt(hidden_size)``, rounded to fp32 as HF does)."""
        x = self.embed[input_ids]
        if self.cfg.embedding_multiplier is not None:
            x = x * torch.tensor(self.cfg.embedding_multiplier, dtype=x.dtype)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` fp32 logits for ``[n, hidden]`` states (soft-capped where the config
        says: Gemma 2's ``final_logit_softcapping``)."""
        logits = self.linear(hidden, self.lm_head)
        cap = self.cfg.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as stored, each counted once (a tied LM head is the
        embedding). With a quantized LM head the fp32 embedding table, looked up by row
        only, is left out: this is what a step that samples reads, as the planner counts it."""
        tensors = [self.norm, self.lm_head]
        if self.lm_head is not self.embed and isinstance(self.lm_head, torch.Tensor):
            tensors.append(self.embed)
        for layer in self.layers:
            tensors += [layer.in_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down]
            tensors += [t for t in (layer.pre_ff_norm, layer.post_ff_norm, layer.q_norm, layer.k_norm) if t is not None]
        return sum(weight_bytes(t) for t in tensors)
