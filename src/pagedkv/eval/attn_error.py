"""Per-layer attention-output error of a KV storage format against the float32 cache.

For each layer, with the float32 model's own activations (teacher-forced, so errors do not
compound from layer to layer): q, k, v of a window are computed once; the float32 output is
causal attention over k, v as they are; a setting's output is the same attention over k, v
stored and read back in that format (quantized with :mod:`pagedkv.kv_cache.quant` exactly as the
cache writes them: per-token-head scales per token, per-head / per-tensor scales from the
engine's calibration text, :mod:`pagedkv.worker.kv_scales`). The error of layer l is

    ||O_setting - O_float32||_F / ||O_float32||_F    over all windows' rows and heads,

and the float32 output feeds the next layer. Attention runs as the pure-torch reference
(the kernel reads the same values; tests/test_attention_kernel_quant.py).
"""

from __future__ import annotations

import torch

from pagedkv.attention.reference import attend
from pagedkv.eval.settings import KVSetting
from pagedkv.kv_cache import quant
from pagedkv.kv_cache.storage import TORCH_DTYPES
from pagedkv.worker.kv_scales import layer_kv


def stored(x: torch.Tensor, setting: KVSetting, calibration: torch.Tensor | None = None,
           values: bool = False) -> torch.Tensor:
    """``x`` ``[T, Hkv, D]`` fp32 keys (or ``values``) as the cache would read them back in
    ``setting``'s format; static scales come from ``calibration`` ``[N, Hkv, D]`` when given,
    else from ``x`` itself."""
    if setting.dtype not in quant.QMAX:
        return x.to(TORCH_DTYPES[setting.dtype]).float()
    gran = quant.key_value_granularities(setting.scale)[1 if values else 0]
    static = gran != "per-token-head" and calibration is not None
    view = quant.scale_view(quant.compute_scales(calibration if static else x, setting.dtype, gran), gran)
    return quant.dequantize(quant.quantize(x, view, setting.dtype), view)


@torch.inference_mode()
def attention_errors(model, windows: list[list[int]], settings: list[KVSetting],
                     calibration_ids: list[int] | None = None) -> dict[str, list[float]]:
    """Relative attention-output error per layer for each setting (label -> ``[num_layers]``).

    ``model`` is a :class:`pagedkv.model.llama.LlamaModel`; ``windows`` token-id lists, each
    scored from position 0; ``calibration_ids`` the text static scales are calibrated on (the
    engine's, :func:`pagedkv.engine.build.engine_calibration_ids`; ``None`` = each window).
    Raises ValueError for no window.
    """
    if not windows:
        raise ValueError("no window to evaluate")
    cal = layer_kv(model, calibration_ids) if calibration_ids else None
    layers = len(model.layers)
    num = {s.label: [0.0] * layers for s in settings}
    den = [0.0] * layers
    scale = model.cfg.attention_scale
    for ids in windows:
        x = model.embed_rows(torch.tensor(ids))
        positions = torch.arange(len(ids))
        for i, layer in enumerate(model.layers):
            q, k, v = layer.project(x, positions, model.layer_ropes[i])
            ref = attend(q, k, v, scale, layer.window, layer.sinks)
            den[i] += float(ref.pow(2).sum())
            ck, cv = cal[i] if cal else (None, None)
            for s in settings:
                out = attend(q, stored(k, s, ck), stored(v, s, cv, values=True), scale, layer.window, layer.sinks)
                num[s.label][i] += float((out - ref).pow(2).sum())
            x = layer.finish(x, ref)
    return {label: [(n / d) ** 0.5 for n, d in zip(errs, den)] for label, errs in num.items()}
