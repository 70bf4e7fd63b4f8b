"""``pagedkv simulate --calibrate``: fit the cost model to this CPU from the real engine.

A short profile of the real engine (:class:`~pagedkv.engine.engine.LLMEngine`, driven by
the benchmark driver after a warm-up) covers the shapes a serving run mixes:

- prefill: one prompt each of :data:`PREFILL_LENS` tokens (chunks up to
  ``max_num_batched_tokens``), which also give the prefill corrections
  (:func:`prefill_factors`);
- decode: :data:`DECODE_SHAPES` (requests at once, prompt tokens), :data:`DECODE_STEPS`
  tokens each (the first step of each batch is a batched prefill); the 1-5 request decodes
  at two context lengths and the 8-request one also give the few-row corrections
  (:func:`few_row_factors`).

The profile runs :data:`REPEATS` times, round robin (a group's repeats a whole profile
apart: back to back, one fast or slow minute set all three, and lone prefills of 192 and 256
tokens came out 30% faster than their neighbours in one sitting and not in the next), and
each step's time is the median over the repeats (the schedule is the same every time; a
shared machine's noise only slows a step down, but a median resists one slow repeat without
trusting one lucky one). Last, :func:`idle_wake_seconds` measures what a step pays for
starting after the engine sat idle.

Every step's roofline terms are counted with the loaded model's own cost (weight bytes
as stored, :func:`pagedkv.bench.roofline.model_cost`) on this machine's measured
ceilings (:func:`pagedkv.planner.hardware.cpu_device`, measured again at the start of the
calibration: the factors are fractions of them, and a cache taken on a busy machine once
read 43 GFLOP/s and 21 GB/s against 212 and 73 on a quiet one), and :func:`pagedkv.sim.fit.fit`
fits the factors. The result, with that cost, is cached as JSON in
``$XDG_CACHE_HOME/pagedkv/sim_calibration.json`` (else ``~/.cache/...``) under a key of the
machine (host, CPUs, torch threads), the model, its weight/activation/KV dtypes and the
numerics mode; a simulation on ``cpu`` with the same settings uses it.

The machine's speed drifts (this shared 2-core VM: 20-30% within minutes), so the entry
also keeps ``reference_s``: the seconds of a fixed small workload (:func:`reference_seconds`)
timed right after the profile; timing it again later says how much faster or slower the
machine is than when it was calibrated (``benchmarks/sim_accuracy.py`` uses this).
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pagedkv.config.engine import EngineConfig
from pagedkv.planner.roofline import ModelCost
from pagedkv.sim.cost import Efficiency

PREFILL_LENS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 1024, 2048)
DECODE_SHAPES = ((1, 64), (2, 64), (3, 64), (4, 64), (5, 64), (1, 512), (2, 512), (3, 512), (4, 512), (5, 512),
                 (16, 64), (48, 64), (64, 192), (8, 512), (32, 256))
DECODE_STEPS = 12
REPEATS = 3
FEW_ROWS = 8  # steps of up to this many token rows get a measured correction
# Steps of FEW_ROWS + 1 .. BATCH_ROWS rows get one too where the profile has MIN_BATCH_STEPS
# steps of exactly that many rows (its batched decodes), tapering to none at twice the last.
BATCH_ROWS = 64
MIN_BATCH_STEPS = 3
SPLIT_RANGE = 5.0  # a few-row (rest, KV) split is kept only within this factor of the one-factor fit
QUICK = {"prefill": (16, 128), "shapes": ((1, 16), (8, 16), (16, 16)), "steps": 4}  # tests


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedkv" / "sim_calibration.json"


def calibration_key(config: EngineConfig, model: str) -> str:
    """What a calibration depends on: the machine, the model and the engine's numerics."""
    from pagedkv.numerics import env_requests_invariance

    invariant = config.batch_invariant or env_requests_invariance()
    return (f"{platform.node()}|cpus={os.cpu_count()}|threads={_threads()}|model={model}"
            f"|weights={config.weight_dtype}|activations={config.activation_dtype}"
            f"|kv={config.kv_cache_dtype}|invariant={invariant}")


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def _load() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError, RecursionError):  # (a file nested past the parser's depth)
        return {}
    return data if isinstance(data, dict) else {}  # a damaged file: as if none


@dataclass(frozen=True)
class Calibration:
    """A cached calibration: the fitted factors, the model cost they were fitted with, and
    the machine's ceilings measured in the same sitting (bytes/s, fp32 FLOP/s), which the
    factors are fractions of (``None``: an entry from before they were kept)."""
    efficiency: Efficiency
    cost: ModelCost
    bandwidth: float | None = None
    fp32_flops: float | None = None
    reference_s: float | None = None  # the drift probe's seconds then (:func:`reference_seconds`)

    def on(self, device):
        """``device`` with this calibration's ceilings (a later re-measure of the machine
        must not rescale factors fitted against these)."""
        if self.bandwidth is None or self.fp32_flops is None:
            return device
        return replace(device, bandwidth=self.bandwidth, flops_16=self.fp32_flops)


def cached(config: EngineConfig, model: str) -> Calibration | None:
    """The cached calibration for these settings on this machine, or None."""
    try:
        return _parse(_load().get(calibration_key(config, model)))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None  # a damaged or foreign entry: as if none (calibrate again)


def _parse(entry) -> Calibration | None:
    if entry is None:
        return None
    known = {f.name for f in fields(Efficiency)}  # fields a later version added are ignored
    eff = Efficiency(**{k: v for k, v in entry["efficiency"].items() if k in known})
    c = entry.get("ceilings") or {}
    bw, flops, ref = c.get("bandwidth"), c.get("fp32_flops"), entry.get("reference_s")
    for v in (bw, flops, ref):
        if v is not None and not (isinstance(v, (int, float)) and 0 < v < math.inf):
            raise ValueError(f"a calibration's ceilings and probe must be positive numbers, got {v!r}")
    return Calibration(eff, ModelCost(**entry["cost"]), bw, flops, ref)


def few_row_factors(cost, phases, reqs, tokens, secs, rows: int = FEW_ROWS,
                    batch_rows: int = BATCH_ROWS) -> tuple[tuple, tuple]:
    """``(few_row, few_row_kv)`` factors (:class:`~pagedkv.sim.cost.Efficiency`) per ``M = 1
    .. rows`` token rows, from the profiled decode steps of exactly ``M`` rows (one per
    request: a prefill chunk of ``M`` tokens is priced by :func:`prefill_factors`): with
    ``(rest, kv)`` each step's modelled parts (:meth:`~pagedkv.sim.cost.StepCost.parts`), the
    non-negative ``(a, b)`` minimizing the relative error of ``a * rest + b * kv`` where the
    steps read KV of at least two sizes (a factor of 2 apart, 4 steps or more) and both lie
    within :data:`SPLIT_RANGE` of the one-factor fit, else one factor for both (the median of
    measured / modelled). Steps without a positive, finite time are left out. An ``M`` without
    steps is interpolated between its neighbours (past the last measured one: nothing, i.e. 1).
    From ``rows + 1`` to ``batch_rows`` rows an ``M`` counts only with :data:`MIN_BATCH_STEPS`
    steps or more (a lone odd step, a prefill chunk's tail, decides nothing there), and past
    the last ``M`` measured the factors return to 1 in a straight line at twice that ``M``: the
    batch-fitted terms price a 64-row decode ~5% and a 48-row one ~20% slow on the AMD EPYC
    family 26 (2026-12-05) where the all-at-once steps before fitted within 1%."""
    from pagedkv.sim.fit import nnls

    factors = {}
    for m in range(1, max(rows, batch_rows) + 1):
        got = [(cost.parts(ph, n), t) for ph, n, k, t in zip(phases, reqs, tokens, secs)
               if k == m == n and 0 < t < math.inf]
        if not got or (m > rows and len(got) < MIN_BATCH_STEPS):
            continue
        r = statistics.median(t / (rest + kv) for (rest, kv), t in got)
        ab = (r, r)
        kvs = [kv for (_, kv), _ in got]
        if len(got) >= 4 and min(kvs) > 0 and max(kvs) >= 2 * min(kvs):
            a = np.array([[rest / t, kv / t] for (rest, kv), t in got])
            x, _ = nnls(a, np.ones(len(got)))
            if all(r / SPLIT_RANGE <= v <= r * SPLIT_RANGE for v in x):  # else noise decided the split
                ab = (float(x[0]), float(x[1]))
        factors[m] = ab
    if not factors:
        return (), ()
    known = sorted(factors)
    last = known[-1]
    if last > rows:  # back to no correction at twice the last measured batch
        factors[2 * last] = (1.0, 1.0)
        known.append(2 * last)
    out = []
    for m in range(1, known[-1] + 1):
        lo = max((k for k in known if k <= m), default=known[0])
        hi = min((k for k in known if k >= m), default=known[-1])
        f_lo, f_hi = factors[lo], factors[hi]
        out.append(f_lo if lo == hi else tuple(a + (b - a) * (m - lo) / (hi - lo) for a, b in zip(f_lo, f_hi)))
    return tuple(a for a, _ in out), tuple(b for _, b in out)


def prefill_factors(cost, phases, reqs, tokens, secs) -> tuple[tuple[int, float], ...]:
    """``(M, prefill[M])`` anchors (:class:`~pagedkv.sim.cost.Efficiency`): for each token
    count ``M`` of the profile's lone prefills (one request, ``M`` > 1 rows), the median of
    measured / modelled seconds over its steps (without the factors; ``cost`` is a
    :class:`~pagedkv.sim.cost.StepCost`). Steps without a positive, finite time are left out."""
    got: dict[int, list[float]] = {}
    for ph, n, k, t in zip(phases, reqs, tokens, secs):
        if n == 1 and k > 1 and 0 < t < math.inf:
            rest, kv = cost.parts(ph, n)
            got.setdefault(k, []).append(t / (rest + kv))
    return tuple((k, statistics.median(v)) for k, v in sorted(got.items()))


IDLE_WAKE_PAIRS = 6
IDLE_S = 0.2  # the idle wait before a wake-up probe (penalties measured at 0.1-1 s: alike)


def idle_wake_seconds(engine, pairs: int = IDLE_WAKE_PAIRS, idle_s: float = IDLE_S) -> float:
    """Seconds a lone 64-token prefill takes longer when the engine sat idle ``idle_s``
    before it than right after another step (``pairs`` of each, alternating; the difference
    of the medians, at least 0): on this VM 2.2-3.5 ms after 0.1-1 s idle, alike at 50 and
    200 tokens (AMD EPYC family 26, 2026-12-05), a wake-up cost, not a rate. The simulator
    adds it to the first step after an idle wait (:data:`pagedkv.sim.runner.IDLE_WAKE_AFTER_S`)."""
    import time

    from pagedkv.bench.driver import drive

    rng = random.Random(2)
    busy, woken = [], []
    for _ in range(pairs):
        for idle, sink in ((False, busy), (True, woken)):
            engine.reset_prefix_cache()
            if idle:
                time.sleep(idle_s)
            sink.append(drive(engine, [_request(rng, 64, 1)], sample_waste=False).step_seconds[0])
    return max(0.0, statistics.median(woken) - statistics.median(busy))


REFERENCE = ((1, 64), (16, 64))  # decode shapes of the drift probe, after one 256-token prefill


def _request(rng: random.Random, prompt_len: int, output_len: int):
    from pagedkv.bench.workloads import BenchRequest

    return BenchRequest(tuple(rng.randrange(100, 30000) for _ in range(prompt_len)), output_len, output_len)


def profile_workload(quick: bool = False, seed: int = 0) -> list:
    """The profile's requests (all arriving at once, in order; random token ids)."""
    rng = random.Random(seed)
    prefill = QUICK["prefill"] if quick else PREFILL_LENS
    shapes = QUICK["shapes"] if quick else DECODE_SHAPES
    steps = QUICK["steps"] if quick else DECODE_STEPS
    return [[_request(rng, n, 1)] for n in prefill] + [[_request(rng, p, steps) for _ in range(b)] for b, p in shapes]


def reference_seconds(engine, repeats: int = REPEATS) -> float:
    """Seconds the engine takes for a fixed small workload (a 256-token prefill, then
    :data:`DECODE_STEPS` decode steps of 1 and of 16 requests), the median over ``repeats``:
    the machine's speed now, to compare with a calibration's ``reference_s``."""
    from pagedkv.bench.driver import drive

    rng = random.Random(1)
    groups = [[_request(rng, 256, 1)]] + [[_request(rng, p, DECODE_STEPS) for _ in range(b)] for b, p in REFERENCE]
    times = []
    for _ in range(repeats):
        engine.reset_prefix_cache()
        times.append(sum(sum(drive(engine, g, sample_waste=False).step_seconds) for g in groups))
    return statistics.median(times)


def calibrate(config: EngineConfig | None = None, quick: bool = False, save: bool = True,
              repeats: int = REPEATS, progress: bool = False) -> dict:
    """Profile the real engine, fit the factors and (``save``) cache them; ``progress``: a
    bar of the profile's runs on stderr (the whole takes minutes).

    Returns ``{"key", "efficiency", "cost", "fit", "ceilings", "reference_s", "steps",
    "samples"}`` (the fit's relative errors, the machine's ceilings and drift probe, the
    number of steps profiled, each step's modelled phases and measured seconds).
    """
    from pagedkv.bench.driver import drive, warm_up
    from pagedkv.bench.roofline import model_cost
    from pagedkv.engine.engine import LLMEngine
    from pagedkv.planner.hardware import cpu_device
    from pagedkv.sim.cost import StepCost
    from pagedkv.sim.fit import fit

    config = config or EngineConfig()
    engine = LLMEngine(config)
    warm_up(engine)
    cost, dev = model_cost(engine), cpu_device(fresh=True, save=save)  # this sitting's ceilings
    probe = StepCost(cost, dev, "int8" if config.activation_dtype == "int8" else "float32")
    phases, reqs, tokens, secs = [], [], [], []
    groups = profile_workload(quick)
    repeated = [[] for _ in groups]
    bar = tqdm(total=repeats * len(groups), desc="profiling the engine", unit="run", file=sys.stderr, leave=False,
               mininterval=2.0, disable=not progress)
    for _ in range(repeats):  # round robin: a group's repeats a whole profile apart, not in one minute
        for group, runs in zip(groups, repeated):
            engine.reset_prefix_cache()
            runs.append(drive(engine, group, sample_waste=False))
            bar.update()
    bar.close()
    for runs in repeated:
        for i, (work, n) in enumerate(zip(runs[0].steps, runs[0].running)):
            phases.append(probe.phases(work))
            reqs.append(n)
            tokens.append(work.tokens)
            secs.append(statistics.median(r.step_seconds[i] for r in runs))
    f = fit(*zip(*phases), reqs, secs)  # every step: without the few-row ones the weight term is not identified
    eff = Efficiency(memory=f.memory, compute=f.compute, kv_read=f.kv_read, attention=f.attention,
                     step_overhead_s=f.step_overhead_s, request_overhead_s=f.request_overhead_s,
                     source=f"calibrated on this CPU ({len(secs)} step shapes of the real engine, median of "
                            f"{repeats} runs each; median |error| "
                            f"{100 * f.median_abs_rel_error:.1f}%, max {100 * f.max_abs_rel_error:.1f}%)")
    probe_eff = StepCost(cost, dev, probe.compute_dtype, eff)
    few, few_kv = few_row_factors(probe_eff, phases, reqs, tokens, secs)
    eff = replace(eff, few_row_factors=few, few_row_kv_factors=few_kv,
                  prefill_factors=prefill_factors(probe_eff, phases, reqs, tokens, secs),
                  idle_wake_s=idle_wake_seconds(engine, 2 if quick else IDLE_WAKE_PAIRS))
    probe_eff = StepCost(cost, dev, probe.compute_dtype, eff)
    key = calibration_key(config, engine.config.model)
    entry = {"efficiency": eff.to_dict(), "cost": cost.to_dict(), "fit": asdict(f),
             "ceilings": {"bandwidth": dev.bandwidth, "fp32_flops": dev.flops_16},
             "reference_s": reference_seconds(engine, 1 if quick else repeats)}
    if save:
        data = _load() | {key: entry}
        try:
            cache_path().parent.mkdir(parents=True, exist_ok=True)
            cache_path().write_text(json.dumps(data, indent=2))
        except OSError:
            pass  # a read-only home: the fit is still returned
    samples = [{"phases_s": list(ph), "requests": n, "tokens": m, "seconds": t,
                "predicted_s": probe_eff.seconds_of(ph, n, m)} for ph, n, m, t in zip(phases, reqs, tokens, secs)]
    return {"key": key} | entry | {"steps": len(secs), "samples": samples}
