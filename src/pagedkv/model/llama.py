"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM, Gemma 2/3) over a paged KV cache.

Per layer: RMSNorm -> fused QKV projection -> RoPE -> write K/V to pages through the
slot mapping -> paged attention (reads through block tables) -> output projection ->
residual; RMSNorm -> SwiGLU MLP (fused gate/up) -> residual. Tokens of all sequences in
a step are flattened into one ``[T, hidden]`` batch (prefill chunks and decodes mixed).
Computes in fp32; the KV storage dtype is the cache's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.reference import attend
from pagedkv.kernels.cpu.library import kernel_supports
from pagedkv.kernels.cpu.ops import layer_op
from pagedkv.kv_cache.storage import KVCacheStorage
from pagedkv.model.config import ModelConfig
from pagedkv.model.int8_weights import Int8Weight, weight_bytes
from pagedkv.model.layer_ops import gemma_norms, op_weight, rms_norm
from pagedkv.model.llama_layer import LlamaLayer
from pagedkv.model.rope import RotaryEmbedding
from pagedkv.model.weight_formats import EMBED, WEIGHT_DTYPES, lm_head_for, prepare_state
from pagedkv.numerics import linear_for


@dataclass(frozen=True)
class ModelSettings:
    """How a :class:`LlamaModel` computes: fixed when it is built (the engine makes these from
    its config in :func:`pagedkv.model.load.load_model`).

    Attributes:
        weight_dtype: the format linear weights are kept in (:mod:`pagedkv.model.weight_formats`):
            float32, int8, auto (a GGUF's blocks as stored) or int4.
        batch_invariant: every product in fixed row tiles, so a row's bits do not depend on
            the batch (:mod:`pagedkv.numerics`).
        all_reduce: tensor parallelism: ``fn(t)`` sums a row-parallel product's output over
            the ranks in place (output projection, MLP down); the one-call layer ops, which do
            not stop between those products, are then not used. None on one rank.
        streaming_window, streaming_sinks: StreamingLLM (Xiao et al. 2023) on every layer that
            reads more than the window: the last ``streaming_window`` tokens and the first
            ``streaming_sinks`` (0: off; a model's own narrower window stays as trained).
        streaming_cache_positions: with streaming, attend at positions within the cache
            (``streaming_positions`` cache), not every token's place in the text.
        fused_layers, fused_stack: allow the kernel library's one-call decoder layer, and then
            its one-call stack of every layer, where they compute exactly what the op-by-op
            path computes (:meth:`LlamaModel.forward_path`).
        device, dtype: where the weights live and the dtype they compute in (float weights
            only, other than on the CPU in float32: :mod:`pagedkv.worker.device`).
    """
    weight_dtype: str = "float32"
    batch_invariant: bool = False
    all_reduce: Callable | None = None
    streaming_window: int = 0
    streaming_sinks: int = 0
    streaming_cache_positions: bool = False
    fused_layers: bool = True
    fused_stack: bool = True
    device: str = "cpu"
    dtype: str = "float32"

    def layer_window(self, window: int | None) -> tuple[int, int]:
        """``(window, sinks)`` of a layer whose own sliding window is ``window`` (None: full)."""
        if self.streaming_window and (not window or window > self.streaming_window):
            return self.streaming_window, self.streaming_sinks
        return int(window or 0), 0

    @property
    def streaming_cache_len(self) -> int | None:
        """Streaming's positions within the cache (sinks + window tokens), or None: original positions."""
        if not self.streaming_window or not self.streaming_cache_positions:
            return None
        return self.streaming_sinks + self.streaming_window


class LlamaModel:
    """Embeddings, decoder layers, final norm and LM head, built from an HF state dict.

    ``settings``: how it computes (:class:`ModelSettings`). ``quantized``: the checkpoint's
    own GGML blocks by HF tensor name (:func:`pagedkv.model.gguf_convert.read_blocks`), which
    ``weight_dtype`` ``auto`` and ``int4`` keep (:mod:`pagedkv.model.weight_formats`);
    ``state`` may then leave those tensors out (the fp32 embedding table is always needed for
    row lookups).

    Raises:
        KeyError: if a tensor the config implies is missing from ``state``.
        ValueError: an unknown ``weight_dtype``.
    """

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], settings: ModelSettings = ModelSettings(),
                 quantized: dict | None = None) -> None:
        w, weight_dtype = dict(state), settings.weight_dtype
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        self.cfg, self.settings = cfg, settings
        self.linear = linear_for(settings.batch_invariant)
        if weight_dtype in ("auto", "int4"):
            w.update({k: v for k, v in (quantized or {}).items() if k != EMBED})
            prepare_state(w, weight_dtype, cfg.num_hidden_layers)
        self.embed = w.pop("model.embed_tokens.weight")         # [vocab, hidden]
        if cfg.model_type.startswith("gemma"):
            gemma_norms(w, cfg.num_hidden_layers)
        windows = cfg.layer_windows or (None,) * cfg.num_hidden_layers
        self.layers = [LlamaLayer(cfg, w, f"model.layers.{i}", *settings.layer_window(windows[i]), self.linear,
                                  settings.all_reduce) for i in range(cfg.num_hidden_layers)]
        self.norm = w.pop("model.norm.weight")
        self.lm_head = w.pop("lm_head.weight", None)
        if self.lm_head is None or cfg.tie_word_embeddings:
            self.lm_head = self.embed
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        local = (None if cfg.local_rope_theta is None else
                 RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                                 cfg.local_rope_scaling))
        #: per layer, its RoPE (Gemma 3's window layers have their own)
        self.layer_ropes = [local if local is not None and layer.window else self.rope for layer in self.layers]
        self._ropes = list({id(r): r for r in self.layer_ropes}.values())  # each once: cos/sin looked up per forward
        self.fused_layers, self.fused_stack = settings.fused_layers, settings.fused_stack  # (benchmarks flip them)
        self._stack_args: tuple | None = None  # decoder_stack's per-layer lists, made once per KV cache
        self.streaming_cache_len = settings.streaming_cache_len
        if weight_dtype == "int8":
            self._quantize_int8()
        elif weight_dtype in ("auto", "int4"):
            tied = self.lm_head is self.embed
            self.lm_head = lm_head_for(self.lm_head, (quantized or {}).get(EMBED), tied, weight_dtype)
        self._fusable: bool | None = None
        self._pages_checked, self._pages_ok = None, False  # the pages fused_op last looked at
        self.device, self.dtype = torch.device(settings.device), getattr(torch, settings.dtype)
        if self.device.type != "cpu" or self.dtype != torch.float32:
            self._place()

    @property
    def batch_invariant(self) -> bool:
        return self.settings.batch_invariant

    def _place(self) -> None:
        """Every weight on the model's device in its dtype (float weights only), the RoPE
        tables on the device in float32 (rotations are computed in float32, then cast)."""
        if self.settings.weight_dtype != "float32":
            raise ValueError(f"weights on {self.device.type} in {self.settings.dtype} must be float "
                             f"(weight_dtype float32 or auto), got {self.settings.weight_dtype!r}")
        move = lambda w: None if w is None else w.to(self.device, self.dtype)  # noqa: E731
        tied = self.lm_head is self.embed
        self.embed, self.norm = move(self.embed), move(self.norm)
        self.lm_head = self.embed if tied else move(self.lm_head)
        for layer in self.layers:
            for name in ("in_norm", "post_norm", "pre_ff_norm", "post_ff_norm", "q_norm", "k_norm", "qkv", "qkv_bias",
                         "o", "gate_up", "down"):
                setattr(layer, name, move(getattr(layer, name)))
        for rope in self._ropes:
            rope.cos, rope.sin, rope.inv = (rope.cos.to(self.device), rope.sin.to(self.device),
                                            rope.inv.to(self.device))

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

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCacheStorage,
                meta: AttentionMetadata | Sequence[AttentionMetadata], kv_hooks=None,
                observer=None, graph_safe: bool = False) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; ``input_ids``/``positions`` ``[T]``;
        ``observer``: see :meth:`LlamaLayer.forward` (it takes the per-op path); ``graph_safe``:
        read nothing back to the host (a CUDA graph's capture: no positions past the RoPE
        table, no streaming sinks).

        ``meta``: one attention metadata for every layer, or one per layer (layers of
        different KV cache groups read different block tables). ``kv_hooks`` (a KV
        connector's worker side, or None): ``wait_for_layer_load(i)`` before layer ``i``
        reads its pages, ``save_kv_layer(i, kv_cache, meta_i)`` after it wrote them.
        """
        metas = meta if isinstance(meta, (list, tuple)) else [meta] * len(self.layers)
        x = self.embed_rows(input_ids)
        per_rope = {id(r): (r.cos_sin(positions, checked=not graph_safe),
                            None if graph_safe else self.sink_cos_sin(positions, r)) for r in self._ropes}
        path, op = self.forward_path(kv_cache, metas, kv_hooks, observer)
        if path == "stack":  # every layer's RoPE is the same one here
            return self.final_norm(self._forward_stack(op, x, *per_rope[id(self.layer_ropes[0])], kv_cache, metas[0]))
        for i, layer in enumerate(self.layers):
            if kv_hooks is not None:
                kv_hooks.wait_for_layer_load(i)
            rope_cos_sin, sink_cos_sin = per_rope[id(self.layer_ropes[i])]
            if path == "layer":
                x = layer.forward_fused(op, x, i, rope_cos_sin, kv_cache, metas[i], sink_cos_sin)
            else:
                x = layer.forward(x, i, positions, self.layer_ropes[i], kv_cache, metas[i], rope_cos_sin,
                                  sink_cos_sin, observer)
            if kv_hooks is not None:
                kv_hooks.save_kv_layer(i, kv_cache, metas[i])
        return self.final_norm(x)

    def forward_path(self, kv_cache: KVCacheStorage, metas, kv_hooks=None, observer=None) -> tuple[str, object]:
        """Which implementation runs a forward, and its op: ``("stack", decoder_stack)`` (every
        layer in one call of the kernel library), ``("layer", decoder_layer)`` (one call per
        layer) or ``("op", None)`` (op by op: attention, norms and products each dispatched on
        its own). The one-call paths compute bit-identically to the op path and are taken only
        where they apply: :meth:`fused_op` for the layer, :meth:`stack_op` for the stack. An
        ``observer`` (KV eviction's scores) needs the op path."""
        fused = self.fused_op(kv_cache) if observer is None else None
        if fused is None:
            return "op", None
        stack = self.stack_op(fused, metas, kv_hooks)
        return ("stack", stack) if stack is not None else ("layer", fused)

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

    def _forward_stack(self, op, x, rope_cos_sin, sink_cos_sin, kv_cache: KVCacheStorage, meta: AttentionMetadata):
        pages = kv_cache.layer(0).k
        if self._stack_args is None or self._stack_args[0] is not pages:  # once per storage
            weights, scales, types = [], [], []
            for layer in self.layers:
                for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
                    values, scale, qtype = op_weight(w)
                    weights.append(values)
                    scales.append(scale)
                    types.append(qtype)
            layers = [kv_cache.layer(i) for i in range(len(self.layers))]
            self._stack_args = (pages, [layer.in_norm for layer in self.layers],
                                [layer.post_norm for layer in self.layers], weights, scales, types,
                                [p.k for p in layers], [p.v for p in layers])
        _, in_norms, post_norms, weights, scales, types, k_pages, v_pages = self._stack_args
        cfg, first = self.cfg, self.layers[0]
        seq_info, block_tables = meta.packed
        sink_cos, sink_sin = sink_cos_sin if sink_cos_sin is not None and first.sinks else (None, None)
        return op(x, in_norms, post_norms, cfg.rms_norm_eps, weights, scales, types, rope_cos_sin[0], rope_cos_sin[1],
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
            sink_cos_sin = self.sink_cos_sin(positions, self.layer_ropes[i])
            q, k, v = layer.project(x, positions, self.layer_ropes[i])
            if on_kv is not None:
                on_kv(i, k, v)
            attn = attend(q, k, v, self.cfg.attention_scale, layer.window, layer.sinks,
                          layer.sink_queries(q, sink_cos_sin), self.cfg.attn_logit_softcapping or 0.0)
            x = layer.finish(x, attn)
        return self.final_norm(x)

    def sink_cos_sin(self, positions: torch.Tensor, rope: RotaryEmbedding | None = None):
        """Streaming's positions within the cache (StreamingLLM, Xiao et al. 2023, sec. 3.2):
        with ``streaming_cache_len`` C = sinks + window, the row at position p sits at cache
        position min(p, C - 1) and the sinks at 0..S-1, so a sink key is scored by q rotated
        back by p - (C - 1) (window keys keep their distance p - j: RoPE scores depend on it
        alone, so their stored keys need no re-rotation). Returns that rotation's (cos, sin)
        ``[T, 1, D]`` (identity where p < C), or None when no row needs one; ``rope``:
        the layer's RoPE (default: the full layers')."""
        if self.streaming_cache_len is None or not positions.numel():
            return None
        back = (positions - (self.streaming_cache_len - 1)).clamp_(min=0)
        if not bool(back.any()):
            return None
        cos, sin = (rope or self.rope).cos_sin(back)
        return cos, -sin

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output ``[T, hidden]`` normed as the LM head takes it."""
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def fused_op(self, kv_cache: KVCacheStorage):
        """``torch.ops.pagedkv.decoder_layer`` where it computes this forward exactly as the
        per-op path would: the kernel library loads and ``PAGEDKV_ATTENTION`` uses it, every
        layer has GGML or int8 weights and no bias, and the pages are unquantized (fp32/fp16/bf16) in
        a shape the attention kernel covers. Else None (and with ``fused_layers`` off)."""
        if not self.fused_layers or self.device.type != "cpu" or self.dtype != torch.float32:
            return None  # (the library's ops are float32 CPU ops)
        op = layer_op("decoder_layer")
        if op is None:
            return None
        if self._fusable is None:  # (the one-call layers take one RoPE table for every layer)
            self._fusable = all(layer.fusable() for layer in self.layers) and len(set(map(id, self.layer_ropes))) == 1
        if not self._fusable:
            return None
        pages = kv_cache.layer(0)
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
        logits = self.linear(hidden, self.lm_head).float()
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
