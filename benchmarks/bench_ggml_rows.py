"""Every layer's product of the default model's GGUF blocks, by activation rows.

Times ``torch.ops.pagedkv.ggml_linear`` (``attention/csrc/ggml_linear.cpp``, fp32
activations) over all of SmolLM2's decoder-layer weights as the engine holds them
(``--weight-dtype auto``: Q4_1 and Q8_0 blocks in panels), for each row count M in ``--rows``:
the products of one decode step of M requests, without attention, norms or the LM head. With
``--activation-dtype int8`` it times ``ggml_a8_linear`` (``ggml_a8_linear.cpp``, activations
quantized inside the op) instead, and the LM head (Q8_0) on its own line. Rounds alternate
over the row counts; the median of ``--rounds`` per M is printed in milliseconds, with
milliseconds per row and the rate in G operations per second (2 per multiply-add).

    python benchmarks/bench_ggml_rows.py --rows 1,2,3,4,5,6,7,8,11 --rounds 7
    python benchmarks/bench_ggml_rows.py --rows 1,16,64 --rounds 9 --activation-dtype int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tp_equivalence import cpu_name

from pagedkv.config.engine import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.model.int8_weights import kernel_op


def products_of(model, lm_head: bool) -> dict[str, list[tuple]]:
    """``{"layers": [...]}`` (and ``"LM head"``) of (packed blocks, in features, out features,
    ggml type) of each GGMLWeight or GGMLA8Weight product. Exits where a layer holds no GGUF blocks."""
    groups = {"layers": [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]}
    if lm_head:
        groups["LM head"] = [model.lm_head]
    if any(getattr(w, "qtype", None) not in (3, 8) for ws in groups.values() for w in ws):
        raise SystemExit("the default model's products are not all GGUF blocks here")
    return {g: [(w.packed, w.shape[1], w.shape[0], w.qtype) for w in ws] for g, ws in groups.items()}


def time_rows(products: dict[str, list[tuple]], call, rows: list[int], rounds: int) -> dict:
    """Median seconds per (group, M) over ``rounds`` alternating rounds."""
    xs = {m: {k: torch.randn(m, k) for k in {p[1] for ps in products.values() for p in ps}} for m in rows}
    times = {(g, m): [] for g in products for m in rows}
    for _ in range(rounds):
        for m in rows:
            for g, ps in products.items():
                t = time.perf_counter()
                for p in ps:
                    call(xs[m][p[1]], p)
                times[(g, m)].append(time.perf_counter() - t)
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,10,11,12",
                   help="activation row counts M, comma-separated (default: 1-12)")
    p.add_argument("--rounds", type=int, default=7,
                   help="rounds over all row counts after one warm-up round; medians are printed (default: 7)")
    p.add_argument("--activation-dtype", choices=("float32", "int8"), default="float32",
                   help="float32: ggml_linear; int8: ggml_a8_linear, with the LM head on its own line")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    name = "ggml_linear" if a.activation_dtype == "float32" else "ggml_a8_linear"
    op = kernel_op(name)
    if op is None:
        raise SystemExit(f"the {name} kernel is not available here (see the warning above)")
    int8 = a.activation_dtype == "int8"
    products = products_of(LLMEngine(EngineConfig(activation_dtype=a.activation_dtype)).model, lm_head=int8)
    if int8:
        call = lambda x, p: op(x, p[0], p[3], p[2])  # noqa: E731
    else:
        call = lambda x, p: op(x, p[0], p[3])  # noqa: E731
    rows = [int(m) for m in a.rows.split(",")]
    time_rows(products, call, rows, 1)  # warm-up: first-touch of the weights, thread pool start
    med = time_rows(products, call, rows, a.rounds)
    ops = {g: 2 * sum(p[1] * p[2] for p in ps) for g, ps in products.items()}
    if a.json:
        print(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(), "rounds": a.rounds,
                          "activation_dtype": a.activation_dtype,
                          "median_ms": {f"{g} M{m}": 1e3 * t for (g, m), t in med.items()}}))
        return 0
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {name}, medians of {a.rounds}")
    for m in rows:
        for g in products:
            ms = 1e3 * med[(g, m)]
            print(f"M {m:3d}  {g:8s} {ms:7.2f} ms  ({ms / m:.2f} ms per row, {ops[g] * m / ms / 1e6:.1f} G op/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
