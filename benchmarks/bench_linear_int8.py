"""What torch's own int8 linear kernels offer on this CPU, for issue 17's quantized weights.

Two measurements on SmolLM2-135M's 30 layers of linear products (qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576), random weights, 2 threads:

1. time per decode step's products at M = 1 / 16 / 64 rows: fp32 ``F.linear`` (MKL);
   FBGEMM dynamic int8 (``torch.ops.quantized.linear_dynamic``: int8 per-channel weights,
   activations quantized per tensor on the fly); weight-only int8
   (``torch._weight_int8pack_mm``: int8 weights, fp32 activations);
2. ``--ppl``: perplexity of the real model (first 4,096 wikitext-2 test tokens, windows of
   512) with every layer's products through FBGEMM dynamic int8, ``reduce_range`` on and
   off, and the LM head too, against fp32 (quality is what rules a kernel in or out).

    python benchmarks/bench_linear_int8.py            # timings, ~30 s
    python benchmarks/bench_linear_int8.py --ppl      # + perplexities, a few minutes
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")  # torch 2.13 deprecation


def prepack(w: torch.Tensor):
    """FBGEMM packed int8 weight, symmetric per output channel (scale = max|w| / 127)."""
    s = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
    q = torch.quantize_per_channel(w, s, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def timings(repeats: int = 5) -> None:
    torch.manual_seed(0)
    ws = [[torch.randn(o, i) * 0.05 for o, i in SHAPES] for _ in range(30)]
    packed = [[prepack(w) for w in layer] for layer in ws]
    int8 = [[(torch.randint(-127, 127, w.shape, dtype=torch.int8), torch.rand(w.shape[0]) * 0.01) for w in layer]
            for layer in ws]
    for m in (1, 16, 64):
        xs = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}
        fns = {
            "fp32": lambda: [F.linear(xs[w.shape[1]], w) for layer in ws for w in layer],
            "fbgemm dynamic int8": lambda: [torch.ops.quantized.linear_dynamic(xs[w.shape[1]], p, True)
                                            for layer, pl in zip(ws, packed) for w, p in zip(layer, pl)],
            "weight-only int8": lambda: [torch._weight_int8pack_mm(xs[q.shape[1]], q, s)
                                         for layer in int8 for q, s in layer],
        }
        row = []
        for name, fn in fns.items():
            fn()
            ts = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            row.append(f"{name} {statistics.median(ts) * 1e3:8.2f} ms")
        print(f"M={m:3d}  " + "  ".join(row))


def perplexities() -> None:
    from pagedkv import LLM
    from pagedkv.eval.ppl import perplexity

    llm = LLM(max_model_len=513, num_blocks=400)
    model = llm.engine.model
    ids = llm.get_tokenizer()(WIKITEXT.read_text(encoding="utf-8")[:60000], add_special_tokens=False).input_ids
    for mode in ("fp32", "int8 reduce_range", "int8", "int8 + LM head"):
        cache: dict[int, object] = {}

        def linear(x, w, b=None, mode=mode, cache=cache):
            if mode == "fp32" or (w is model.lm_head and mode != "int8 + LM head"):
                return F.linear(x, w, b)
            if id(w) not in cache:
                cache[id(w)] = prepack(w)
            p = cache[id(w)]
            y = torch.ops.quantized.linear_dynamic(x.contiguous(), p, mode == "int8 reduce_range")
            return y if b is None else y + b
        model.linear = linear
        for layer in model.layers:
            layer.linear = linear
        r = perplexity(llm, ids, 4096, 512)
        print(f"{mode:>20}: ppl {r.ppl:.4f} over {r.num_scored_tokens} tokens")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ppl", action="store_true", help="also measure perplexity with FBGEMM dynamic int8")
    a = p.parse_args()
    timings()
    if a.ppl:
        perplexities()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
