"""The simulator against the real engine on this CPU (issue 15's accuracy check).

For each scenario the real engine runs the workload ``--repeats`` times (``pagedkv
bench``'s driver, wall clock; each metric is the median over the repeats), then the
simulator runs the same requests: with the cost model calibrated on this CPU (``pagedkv
simulate --calibrate``, run first, so calibration and runs share the machine's weather),
and once per real run with the cost model replaced by that run's recorded step times
(the schedule must then match it exactly: preemptions, peak KV blocks, steps).
Scenarios (the ``pagedkv bench`` defaults): throughput (arena-hard, 64 prompts, all at
once), capacity (hh-rlhf at a 128 MiB KV budget, paged and contiguous) and online
(arena-hard, 32 prompts of 64 output tokens, Poisson arrivals at three rates).

The online rates are fractions (0.15, 0.4, 0.7) of this machine's saturation rate, so that
one is well below saturation on any CPU: the saturation rate is estimated from the
throughput scenario's real run (its output tokens/s over the online requests' 64 tokens;
an upper estimate, since those requests have more prompt per output token). Fixed rates
(``--rates 0.5,2,4``, the rates used before 2026-12-03) put 4 req/s far past saturation on
an AVX2-only CPU, where queueing multiplies any step error into TTFT.

The machine drifts (20-30% within minutes here), and the simulator cannot know the
weather of a later run. So a drift probe (:func:`pagedkv.sim.calibrate.reference_seconds`,
~4 s) is timed right after the calibration and before and after every real run; each
real run's drift is the mean of the probes around it over the calibration's. The
simulator is scored twice: as is (``cost_model_error``) and with every step time scaled
by each run's drift (``drift_adjusted_error``: the median over the runs' simulations
against the median of the real runs).

    python benchmarks/sim_accuracy.py --output benchmarks/results/sim_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

from pagedkv.bench.driver import drive, warm_up
from pagedkv.bench.workloads import build_workload, with_poisson_arrivals
from pagedkv.config.engine import DEFAULT_MODEL, EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.model.loader import load_tokenizer, resolve_model
from pagedkv.sim.calibrate import cached, calibrate, reference_seconds
from pagedkv.sim.run import extra_metrics, sim_setup
from pagedkv.sim.runner import RecordedTimes, SimRunner

SCENARIOS = [  # name, dataset, prompts, max prompt tokens, max tokens, rate, engine flags
    ("throughput", "arena-hard", 64, 512, 128, float("inf"), {}),
    ("capacity", "hh-rlhf", 64, 512, 256, float("inf"), {"kv_cache_memory": "128MiB"}),
    ("capacity-contiguous", "hh-rlhf", 64, 512, 256, float("inf"),
     {"kv_cache_memory": "128MiB", "kv_allocator": "contiguous"}),
]
ONLINE = ("arena-hard", 32, 512, 64)  # dataset, prompts, max prompt tokens, max tokens (rate and flags added)
RATE_FRACTIONS = (0.15, 0.4, 0.7)  # of the estimated saturation rate (see the module docstring)
ERROR_KEYS = ("output_tokens_per_s", "ttft_p50", "tpot_p50")


def summary(m: dict) -> dict:
    return {"output_tokens_per_s": m["output_tokens_per_s"], "ttft_p50": m["ttft_s"]["p50"],
            "tpot_p50": m["tpot_s"]["p50"], "preemptions": m["preemptions"], "peak_kv_blocks": m["peak_kv_blocks"],
            "steps": m["steps"], "duration_s": m["duration_s"], "num_blocks": m["num_blocks"]}


def simulated(setup, requests, recording=None, scale: float = 1.0) -> dict:
    """The simulator's metrics: on the cost model (every step time times ``scale``), or
    on a real run's recorded step times."""
    engine = setup.engine()
    clock = engine.clock
    if recording is not None:  # the cost model replaced by the real run's step times
        engine.core.runner = SimRunner(clock, replay=RecordedTimes.of(recording))
    elif scale != 1.0:
        times = engine.runner.times
        engine.runner.times = lambda i, work, n, kind=None: scale * times(i, work, n, kind)
    run = drive(engine, requests, clock=clock, sleep=engine.runner.sleep)
    return summary(run.metrics() | extra_metrics(run))


def errors(sim: dict, real: dict) -> dict:
    return {k: (sim[k] - real[k]) / real[k] for k in ERROR_KEYS if real[k]}


def scenario(tok, repeats, probe, ref0, name, dataset, n, cap, max_tokens, rate, flags) -> dict:
    reqs = with_poisson_arrivals(build_workload(dataset, tok, n, cap, max_tokens), rate, seed=0)
    config = EngineConfig(**flags)
    setup = sim_setup(DEFAULT_MODEL, "cpu", 1, config)
    reals, replays, probes, runs = [], [], [reference_seconds(probe)], []
    for _ in range(repeats):
        engine = LLMEngine(config)  # fresh: pages and prefix cache start empty
        if setup.num_blocks != engine.kv_manager.pool.num_blocks:
            raise AssertionError(f"{name}: simulated pool {setup.num_blocks} != engine's "
                                 f"{engine.kv_manager.pool.num_blocks}")
        warm_up(engine)
        run = drive(engine, reqs)
        del engine
        runs.append(run)
        probes.append(reference_seconds(probe))
        reals.append(summary(run.metrics()))
        replays.append(simulated(setup, reqs, run))
    drifts = [(a + b) / 2 / ref0 for a, b in zip(probes, probes[1:])]
    real = {k: statistics.median(r[k] for r in reals) for k in reals[0]}
    adjusted = [simulated(setup, reqs, scale=d) for d in drifts]
    adjusted_median = {k: statistics.median(a[k] for a in adjusted) for k in ERROR_KEYS}
    out = {"real": real, "real_runs": reals, "cost_model": simulated(setup, reqs), "replays": replays,
           "probes_s": probes, "drifts": drifts, "drift_adjusted": adjusted}
    out["cost_model_error"] = errors(out["cost_model"], real)
    out["drift_adjusted_error"] = errors(adjusted_median, real)
    out["replay_matches"] = {k: all(p[k] == r[k] for p, r in zip(replays, reals))
                             for k in ("preemptions", "peak_kv_blocks", "steps")}
    print(name, json.dumps(out), flush=True)
    return out


def online_rates(spec: str, results: dict) -> list[float]:
    """The online scenarios' rates (req/s): given, or fractions of the saturation rate
    estimated from the throughput scenario's real output tokens/s."""
    if spec != "auto":
        return [float(r) for r in spec.split(",")]
    saturation = results["throughput"]["real"]["output_tokens_per_s"] / ONLINE[3]
    return [round(f * saturation, 2) for f in RATE_FRACTIONS]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--only", help="comma list of scenario names")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-calibrate", action="store_true", help="use the cached calibration")
    p.add_argument("--rates", default="auto",
                   help="the online scenarios' request rates (req/s, comma list), or auto: fractions "
                        f"{RATE_FRACTIONS} of the saturation rate the throughput scenario measured")
    a = p.parse_args()
    if a.rates == "auto" and a.only and "throughput" not in a.only.split(","):
        p.error("--rates auto needs the throughput scenario (it measures the saturation rate)")
    t0 = time.time()
    if not a.no_calibrate or cached(EngineConfig(), DEFAULT_MODEL) is None:
        calibrate(EngineConfig())
    cal = cached(EngineConfig(), DEFAULT_MODEL)
    if cal.reference_s is None:
        raise SystemExit("the cached calibration has no drift probe: run without --no-calibrate")
    probe = LLMEngine(EngineConfig())  # the drift probe's engine, kept for the whole run
    warm_up(probe)
    tok = load_tokenizer(resolve_model(DEFAULT_MODEL).folder)
    only = set(a.only.split(",")) if a.only else None
    results = {s[0]: scenario(tok, a.repeats, probe, cal.reference_s, *s) for s in SCENARIOS
               if only is None or s[0] in only}
    for rate in online_rates(a.rates, results):
        name = f"online-{rate:.3g}"
        if only is None or name in only or "online" in only:
            results[name] = scenario(tok, a.repeats, probe, cal.reference_s, name, *ONLINE[:4], rate, {})
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    doc = {"cpu": model_name, "host": platform.node(), "efficiency": cal.efficiency.to_dict(),
           "calibration_reference_s": cal.reference_s, "scenarios": results, "repeats": a.repeats,
           "wall_s": time.time() - t0,
           "command": f"python benchmarks/sim_accuracy.py --output {a.output} --repeats {a.repeats} --rates {a.rates}"}
    with open(a.output, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
