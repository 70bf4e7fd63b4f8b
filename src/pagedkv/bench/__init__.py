"""``pagedkv bench``: workloads from real data, the engine and its baselines side by side,
and every throughput as a fraction of this machine's measured roofline.

- :mod:`~pagedkv.bench.workloads` bundled data -> ``BenchRequest`` lists (arena-hard,
  hh-rlhf, shared-prefix), Poisson arrivals.
- :mod:`~pagedkv.bench.driver` drives ``LLMEngine.step()``, injecting arrivals by time and
  sampling KV waste, blocks and running requests after every step.
- :mod:`~pagedkv.bench.baselines` HF static batches, HF continuous batching, llama.cpp.
- :mod:`~pagedkv.bench.metrics` percentiles, TTFT/TPOT/ITL/e2e, waste.
- :mod:`~pagedkv.bench.roofline` measured ceilings and the loaded model's cost, priced by
  the planner's cost model (:mod:`pagedkv.planner.roofline`) -> lower bounds.
- :mod:`~pagedkv.bench.suite` / :mod:`~pagedkv.bench.prefix` the commands;
  :mod:`~pagedkv.bench.report` JSON, medians, ratios, goals, plot; :mod:`~pagedkv.bench.cli`.
"""
