"""Every layer's product of the default model's GGUF blocks (fp32 activations), by activation rows.

Times ``torch.ops.pagedkv.ggml_linear`` (``attention/csrc/ggml_linear.cpp``) over all of
SmolLM2's decoder-layer weights as the engine holds them (``--weight-dtype auto``: Q4_1 and
Q8_0 blocks in panels), for each row count M in ``--rows``: the products of one decode step of
M requests, without attention, norms or the LM head. Rounds alternate over the row counts;
the median of ``--rounds`` per M is printed in milliseconds, with milliseconds per row (the
kernel's cost per row is not flat: it widens each weight once per tile of activation rows).

    python benchmarks/bench_ggml_rows.py --rows 1,2,3,4,5,6,7,8,11 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedkv.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.model.int8_weights import kernel_op
from pagedkv.model.llama import _op_weight

from tp_equivalence import cpu_name


def layer_weights(model) -> list[tuple[torch.Tensor, int, int]]:
    """(packed blocks, ggml type, in features) of every decoder-layer product."""
    out = []
    for layer in model.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            values, _, qtype = _op_weight(w)
            out.append((values, qtype, values.shape[1] // (20 if qtype == 3 else 34) * 32))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,10,11,12")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    op = kernel_op("ggml_linear")
    if op is None:
        raise SystemExit("the ggml_linear kernel is not available here (see the warning above)")
    weights = layer_weights(LLMEngine(EngineConfig()).model)
    if any(q not in (3, 8) for _, q, _ in weights):
        raise SystemExit("the default model's layers are not all GGUF blocks here")
    rows = [int(m) for m in a.rows.split(",")]
    xs = {m: {k: torch.randn(m, k) for k in {k for _, _, k in weights}} for m in rows}
    times = {m: [] for m in rows}
    for _ in range(a.rounds):
        for m in rows:
            t = time.perf_counter()
            for values, qtype, k in weights:
                op(xs[m][k], values, qtype)
            times[m].append(time.perf_counter() - t)
    med = {m: 1e3 * statistics.median(v) for m, v in times.items()}
    if a.json:
        print(json.dumps({"cpu": cpu_name(), "threads": torch.get_num_threads(), "rounds": a.rounds,
                          "median_ms": med}))
    else:
        print(f"{cpu_name()}, {torch.get_num_threads()} threads, medians of {a.rounds}")
        for m in rows:
            print(f"M {m:3d}  {med[m]:7.1f} ms  ({med[m] / m:.2f} ms per row)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
