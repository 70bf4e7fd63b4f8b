"""Where one decode step's time goes: medians of the engine step and its phases.

Runs one request (or ``--batch`` of them) on the default model, greedy, past its prefill,
then times ``--steps`` decode steps with ``time.perf_counter`` wrappers on the instances:
``LLMEngine.step``, ``ModelRunner.execute``, ``LlamaModel.forward`` (the decoder layers),
``LlamaModel.logits`` (the LM head), ``ModelRunner._sample`` (head + sampling),
``ModelRunner.prepare`` and the scheduler's ``schedule`` / ``update``. What the forward
spends outside its kernels is Python and dispatch (compare with ``torch.profiler``).

    python benchmarks/bench_step_phases.py --steps 200 [--per-op] [--weight-dtype int8 [--activation-dtype int8]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedkv import LLM, SamplingParams

PROMPT = "Tell me a long story about a dragon and a knight."


def wrap(obj, name: str, sink: list[float]) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)
    setattr(obj, name, timed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--per-op", action="store_true", help="run each layer op by op (no fused decoder_layer)")
    p.add_argument("--weight-dtype", default="auto")
    p.add_argument("--activation-dtype", default="float32")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    eng = LLM(num_blocks=1024, weight_dtype=a.weight_dtype, activation_dtype=a.activation_dtype).engine
    eng.model.fused_layers = not a.per_op
    for _ in range(a.batch):
        eng.add_request(PROMPT, SamplingParams(max_tokens=a.steps + 16, temperature=0.0, ignore_eos=True))
    for _ in range(8):  # prefill and warm-up
        eng.step()
    r, s = eng.runner, eng.scheduler
    phases = {k: [] for k in ("step", "execute", "forward", "logits", "sample", "prepare", "schedule", "update")}
    for obj, name, key in ((eng, "step", "step"), (r, "execute", "execute"), (r.model, "forward", "forward"),
                           (r.model, "logits", "logits"), (r, "_sample", "sample"), (r, "prepare", "prepare"),
                           (s, "schedule", "schedule"), (s, "update", "update")):
        wrap(obj, name, phases[key])
    for _ in range(a.steps):
        eng.step()
    med = {k: statistics.median(v) * 1e3 for k, v in phases.items() if v}
    if a.json:
        print(json.dumps({"batch": a.batch, "steps": a.steps, "per_op": a.per_op, "weight_dtype": a.weight_dtype,
                          "activation_dtype": a.activation_dtype, "median_ms": med}))
    else:
        for k, v in med.items():
            print(f"{k:10s} {v:8.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
