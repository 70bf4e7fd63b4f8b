"""Where a per-tensor KV scale loses, in numbers: (1) a synthetic cache with one outlier KV head
(x30) and one outlier channel (x10), round-tripped through each format and scale granularity,
RMS error on the *other* heads; (2) the real model's keys on a fixed text: how far the largest
KV head and the largest channel stand above the typical one, per layer, which is what a
per-tensor (or per-head) scale has to cover.

    python benchmarks/kv_outlier_demo.py                 # a few seconds, plus model load
    python benchmarks/kv_outlier_demo.py --no-model      # only the synthetic part
"""

from __future__ import annotations

import argparse

import torch

from pagedkv.kv_cache import quant

GRANS = ("per-token-head", "per-head", "per-tensor")


def synthetic(seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 3, 64, generator=g)          # [tokens, kv_heads, head_dim]
    x[:, 1] *= 30.0                                    # an outlier head
    x[:, :, 7] *= 10.0                                 # an outlier channel
    normal = [0, 2]
    print("synthetic K: 512 tokens x 3 KV heads x 64, head 1 scaled x30, channel 7 x10;")
    print("RMS round-trip error on heads 0 and 2 (unit-variance values)\n")
    print(f"{'dtype':<10}" + "".join(f"{g:>16}" for g in GRANS) + f"{'per-tensor / per-token-head':>30}")
    for dtype in quant.QMAX:
        errs = {}
        for gran in GRANS:
            s = quant.scale_view(quant.compute_scales(x, dtype, gran), gran)
            back = quant.dequantize(quant.quantize(x, s, dtype), s)
            errs[gran] = (back - x)[:, normal].pow(2).mean().sqrt().item()
        print(f"{dtype:<10}" + "".join(f"{errs[g]:>16.4f}" for g in GRANS)
              + f"{errs['per-tensor'] / errs['per-token-head']:>29.1f}x")


def real_model() -> None:
    from pagedkv import LLM
    from pagedkv.worker.kv_scales import calibration_ids, layer_kv

    llm = LLM(kv_cache_memory="64MiB")
    kv = layer_kv(llm.engine.parts.model, calibration_ids(llm.get_tokenizer()))
    print("\nreal model (smollm2-135m-instruct), keys of the 512-token calibration text, per layer:")
    print("max over KV heads of a head's amax / median head amax; max channel amax / median channel amax\n")
    print(f"{'layer':>5} {'head ratio':>11} {'channel ratio':>14}")
    rows = []
    for i, (k, _) in enumerate(kv):
        heads = k.abs().amax(dim=(0, 2))                 # [kv_heads]
        chans = k.abs().amax(dim=0).flatten()            # [kv_heads * head_dim]
        rows.append((i, (heads.max() / heads.median()).item(), (chans.max() / chans.median()).item()))
    for i, h, c in rows:
        print(f"{i:>5} {h:>11.2f} {c:>14.1f}")
    worst = max(rows, key=lambda r: r[2])
    print(f"\nlargest channel outlier: layer {worst[0]}, {worst[2]:.1f}x the median channel")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-model", action="store_true", help="skip the real-model part")
    a = p.parse_args()
    synthetic()
    if not a.no_model:
        real_model()


if __name__ == "__main__":
    main()
