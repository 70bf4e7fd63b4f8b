"""Static KV scales (per-head, per-tensor) calibrated once, at engine start.

A static scale must be fixed before any request writes with it. Taking it from a layer's
first write made every request's precision depend on which request came first (a 1-token
first request left a scale that clipped later keys: perplexity +50% in a break-it test),
and broke batch invariance. Instead the engine runs a fixed calibration text through the
model (float32 activations, attention over float32 K/V, as :mod:`pagedkv.eval.attn_error`
does) and sets each layer's K and V scales from the amax of that text's keys and values,
per KV head or per layer. Values beyond the calibrated range saturate at the format's
maximum (:mod:`pagedkv.kv_cache.quant`).

The text: the bundled Shakespeare sonnets (public domain) followed by arena-hard prompts
(Apache-2.0), i.e. prose plus chat questions; ``pagedkv.model.load.CALIBRATION_TOKENS`` tokens of it (fewer
if the model's own position or window limit is shorter; never tied to the cache size, so
every engine of a model gets the same scales). This is the same "calculate scales on a calibration pass"
idea as vLLM's ``calculate_kv_scales``, done on fixed data so every run gets the same scales.
"""

from __future__ import annotations

import torch


def layer_kv(model, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's fp32 (k, v) ``[T, Hkv, D]`` for ``token_ids`` run through ``model`` (a
    :class:`pagedkv.model.llama.LlamaModel`) with float32 activations and attention."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    model.dense_forward(token_ids, lambda i, k, v: out.append((k, v)))
    return out


def calibrate_static_scales(model, storage, token_ids: list[int]) -> None:
    """Set every layer's static K/V scales of ``storage`` from ``token_ids`` run through
    ``model``. Raises ValueError for no tokens."""
    if not token_ids:
        raise ValueError("calibration needs at least one token")
    for i, (k, v) in enumerate(layer_kv(model, token_ids)):
        storage.set_static_scales(i, k, v)
