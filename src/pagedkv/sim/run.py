"""``simulate()``: a workload through the engine's scheduler on a cost-model clock.

    from pagedkv import simulate
    r = simulate(model="llama-3-70b", gpu="a100-80gb-sxm4", tp=4, workload="sharegpt-like",
                 num_prompts=1000, request_rate=2.0)
    r.metrics["ttft_s"]["p50"], r.metrics["output_tokens_per_s"]

The pool is the planner's ``num_blocks`` for the device (memory x utilization - weights / tp,
or ``kv_cache_memory``), so the simulated cache is the one ``pagedkv plan`` prints; the
steps are priced by :class:`~pagedkv.sim.cost.StepCost` (on ``cpu`` with this machine's
calibration when one is cached, :mod:`pagedkv.sim.calibrate`); the workload is driven by
the benchmark's own driver (:func:`pagedkv.bench.driver.drive`), so the metrics are
``pagedkv bench``'s.
"""

from __future__ import annotations

import gc
import math
import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from pagedkv.bench.driver import EngineRun, drive
from pagedkv.bench.workloads import BenchRequest, with_poisson_arrivals, workload_summary
from pagedkv.config.engine import CPU_KV_CACHE_MEMORY, WEIGHT_DTYPES, EngineConfig
from pagedkv.core.kv_eviction import eviction_policy
from pagedkv.core.kv_layout import kv_groups
from pagedkv.kv.groups import shared_page_slots
from pagedkv.model.config import ENGINE_MAX_POSITIONS, ModelConfig
from pagedkv.planner.hardware import disk_block_load_seconds, get_device, nvme_write_bandwidth
from pagedkv.planner.models import load_model
from pagedkv.planner.plan import plan, tier_link
from pagedkv.planner.roofline import config_cost, layer_window_mix
from pagedkv.reprs import brief
from pagedkv.sim.clock import VirtualClock
from pagedkv.sim.cost import Efficiency, StepCost
from pagedkv.sim.engine import SimEngine
from pagedkv.sim.runner import SimRunner, cost_model_times
from pagedkv.sim.spec import SpecDraws, alpha_for
from pagedkv.sim.tier import TierCosts, sim_tier_worker
from pagedkv.sim.workloads import (
    MAX_ARRIVAL_S,
    SYNTHETIC,
    check_requests,
    dataset_workload,
    load_trace,
    synthetic_workload,
)


@dataclass
class SimResult:
    """One simulated run: the settings, the benchmark metrics and the timelines.

    ``metrics`` is :meth:`pagedkv.bench.driver.EngineRun.metrics` (seconds are simulated);
    ``timeline`` holds, per step, its start (simulated seconds), KV blocks in use after it,
    requests running and waiting; ``wall_s`` and ``events_per_s`` say how fast the
    simulator itself ran (events: steps, arrivals and completions).
    """
    settings: dict
    metrics: dict
    timeline: dict = field(repr=False)
    wall_s: float
    events_per_s: float
    run: EngineRun = field(repr=False)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "metrics": self.metrics, "timeline": self.timeline,
                "wall_s": self.wall_s, "events_per_s": self.events_per_s}


@dataclass(frozen=True)
class SimSetup:
    """What a simulation runs on: the model, its pool size and its step cost."""
    config: EngineConfig
    model_name: str
    num_blocks: int
    step_cost: StepCost
    settings: dict
    spec_acceptance_rate: float | None = None  # speculative decoding: accepted / drafted
    draft_cost: StepCost | None = None         # the draft model's step cost (draft_model only)
    seed: int = 0
    tier: TierCosts | None = None              # the KV tiers' page copy costs

    def engine(self, connector=None) -> SimEngine:
        """A fresh simulated engine (``connector``: a KV connector for it, e.g. a decode
        instance's remote prefill)."""
        clock = VirtualClock()
        m = sim_model(self.model_name)
        sc = self.config.speculative_config
        draws = (SpecDraws(sc.num_speculative_tokens, self.spec_acceptance_rate, self.seed, self.draft_cost)
                 if sc is not None and self.spec_acceptance_rate is not None else None)
        runner = SimRunner(clock, cost_model_times(self.step_cost), windows=read_windows(m, self.config),
                           spec_draws=draws, eviction=eviction_policy(self.config),
                           tier=sim_tier_worker(self.config, self.tier),
                           idle_wake_s=self.step_cost.efficiency.idle_wake_s)
        return SimEngine(self.config, m, self.num_blocks, self.step_cost.cost, runner, clock, connector)


def sim_model(name: str) -> ModelConfig:
    """A planner model as the simulator runs it: any architecture (only shapes matter), with
    the engine's default positions where the config names none."""
    m = load_model(name)
    return replace(m, max_position_embeddings=m.max_position_embeddings or ENGINE_MAX_POSITIONS)


def read_windows(m: ModelConfig, config: EngineConfig) -> tuple[tuple[int | None, float], ...]:
    """What each layer's attention reads: its sliding window, or under streaming eviction
    the sinks plus the window (:func:`~pagedkv.planner.roofline.layer_window_mix`)."""
    windows = m.layer_windows or (None,) * m.num_hidden_layers
    if config.kv_eviction == "streaming":
        cap = config.kv_window_tokens
        windows = tuple(w if w is not None and w <= cap else config.num_sink_tokens + cap for w in windows)
    return layer_window_mix(windows)


def sim_setup(model: str, gpu: str, tp: int = 1, config: EngineConfig | None = None, weight_dtype: str = "auto",
              gpu_memory_utilization: float = 0.9, kv_cache_memory: int | str | None = None,
              efficiency: Efficiency | str | os.PathLike | None = None, spec_acceptance_rate: float | None = None,
              seed: int = 0) -> SimSetup:
    """Resolve a simulation's model, device and pool (see :func:`simulate` for the arguments).

    Raises:
        ValueError: unknown model or GPU, a bad number, or weights that leave no room for
            even one KV page on a device.
    """
    config = config or EngineConfig()
    dev = get_device(gpu)
    if efficiency is not None and not isinstance(efficiency, Efficiency):
        from pagedkv.sim.gpu_fits import fit_mismatch, load_efficiency

        why = fit_mismatch(efficiency, dev.name, model, tp)
        if why:
            warnings.warn(why, UserWarning, stacklevel=3)
        efficiency = load_efficiency(efficiency)  # a name or a path; anything else: ValueError
    if dev.is_cpu and kv_cache_memory is None:
        kv_cache_memory = config.kv_cache_memory or CPU_KV_CACHE_MEMORY  # the engine's own default budget
    sc = config.speculative_config
    draft_model = sc if sc is not None and sc.method == "draft_model" else None
    # a draft model: the planner takes its weights off the budget and sizes pages holding both models' KV
    p = plan(model, gpu, kv_cache_dtype=config.kv_cache_dtype, weight_dtype=weight_dtype,
             seq_len=config.max_model_len or 4096, tp=tp, gpu_memory_utilization=gpu_memory_utilization,
             block_size=config.block_size, kv_cache_memory=kv_cache_memory,
             kv_scale_granularity=config.kv_cache_scale, speculative_config=draft_model)
    m = load_model(model)
    num_blocks = config.num_blocks or p.num_blocks
    page = sim_page_bytes(m, p, config, tp)
    draft = draft_parts(config, p, dev, tp, spec_acceptance_rate)
    if draft is not None:  # pages hold both models' KV (one pool, as the engine keeps them)
        page += draft[1]
    # the plan's pool in this layout's pages (a hybrid model on one group: whole-layer pages)
    elif not config.num_blocks:
        num_blocks = num_blocks * m.kv_spec(p.kv_cache_dtype, config.block_size, tp,
                                            config.kv_cache_scale).page_size_bytes // page
    check_pool(m, p, dev, config, tp, num_blocks, kv_cache_memory is not None, page)
    cost, w_dtype = step_cost(m, p, dev, config, model, tp, weight_dtype, efficiency)
    eff = cost.efficiency
    settings = {"model": p.model, "gpu": dev.name, "gpu_label": dev.label, "tp": tp, "weight_dtype": w_dtype,
                "kv_cache_dtype": p.kv_cache_dtype, "num_blocks": num_blocks, "block_size": config.block_size,
                "cache_budget_bytes": p.cache_budget_bytes, "efficiency": eff.to_dict(),
                "bandwidth_bytes_per_s": cost.device.bandwidth, "matmul_flops": cost.device.matmul_rate(p.weight_dtype),
                "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                "enable_prefix_caching": config.enable_prefix_caching, "kv_allocator": config.kv_allocator}
    if config.speculative_config is not None:
        settings |= {"speculative_config": config.speculative_config.__dict__,
                     "spec_acceptance_rate": spec_acceptance_rate}
    tier = tier_costs(config, dev, page, [m.kv_spec(p.kv_cache_dtype, config.block_size, tp, config.kv_cache_scale)])
    if tier is not None:
        settings |= {"kv_offload_memory": config.kv_offload_memory, "host_link_bytes_per_s": tier.link}
        if config.kv_offload_dir is not None:
            settings |= {"kv_offload_disk_size": config.kv_offload_disk_size,
                         "disk_block_load_s": tier.disk_load_s, "disk_block_write_s": tier.disk_write_s}
    return SimSetup(config, model, num_blocks, cost, settings, spec_acceptance_rate,
                    None if draft is None else StepCost(draft[0], cost.device, p.weight_dtype, eff), seed, tier)


def tier_costs(config: EngineConfig, dev, page: int, specs) -> TierCosts | None:
    """The KV tiers' page copy costs on ``dev`` (None without ``kv_offload_memory``), as the
    planner prices them: whole pages at :func:`~pagedkv.planner.plan.tier_link` (PCIe one
    way; a CPU: its page copy rate at the page's piece size, ``specs`` the pool's KV specs),
    disk pages at the catalog's NVMe rates and then that link
    (:func:`~pagedkv.planner.hardware.disk_block_load_seconds`)."""
    if config.kv_offload_memory is None:
        return None
    link = tier_link(dev, specs, page) or dev.bandwidth
    return TierCosts(page, link, disk_block_load_seconds(page, link), page / nvme_write_bandwidth())


def draft_parts(config: EngineConfig, p, dev, tp: int, rate: float | None):
    """A draft model's (cost, page bytes) for speculative decoding with ``draft_model``
    (the draft: a planner model name or config.json path, priced on the same device and
    dtypes); None for n-gram drafts or none.

    Raises:
        ValueError: speculative decoding without an acceptance rate, or an unknown draft.
    """
    sc = config.speculative_config
    if sc is None:
        if rate is not None:
            raise ValueError("a draft acceptance rate (spec_acceptance_rate, --spec-acceptance-rate) needs "
                             "speculative decoding (speculative_config, --speculative-config)")
        return None
    if rate is None:
        raise ValueError("speculative decoding is simulated at a given draft acceptance rate: pass "
                         "spec_acceptance_rate (--spec-acceptance-rate), accepted / drafted as pagedkv bench "
                         "reports it")
    alpha_for(rate, sc.num_speculative_tokens)  # a rate outside [0, 1] is refused here, before any step
    if sc.method != "draft_model":
        return None
    dm = sim_model(sc.model)
    dspec = dm.kv_spec(p.kv_cache_dtype, config.block_size, tp, config.kv_cache_scale)
    return config_cost(dm, dspec, p.weight_dtype, tp), replace(dspec, page_layers=0).page_size_bytes


def sim_page_bytes(m: ModelConfig, p, config: EngineConfig, tp: int) -> int:
    """Bytes of one page as the engine would lay out this configuration: the hybrid layout's
    (one group's layers) where its KV groups share pages, else every layer's."""
    spec = m.kv_spec(p.kv_cache_dtype, config.block_size, tp, config.kv_cache_scale)
    sc = config.speculative_config
    has_draft = sc is not None and sc.method == "draft_model"
    if spec.page_layers and shared_page_slots(kv_groups(config, m, has_draft)) is None:
        spec = replace(spec, page_layers=0)
    return spec.page_size_bytes


def check_pool(m: ModelConfig, p, dev, config: EngineConfig, tp: int, num_blocks: int, budget_given: bool,
               page: int) -> None:
    """Refuse what no device of the plan ``p`` runs: a tp that does not split the heads,
    no room for one block, or a pool that with the weights exceeds the device's memory.

    Raises:
        ValueError: naming the numbers.
    """
    if m.num_attention_heads % tp:
        raise ValueError(f"tp {tp} does not split {p.model}'s {m.num_attention_heads} attention heads evenly")
    if num_blocks < 1 and budget_given:
        raise ValueError(f"a KV cache budget of {p.cache_budget_bytes:,} bytes per device holds no block of "
                         f"{config.block_size} tokens ({page:,} bytes) beside the engine's reserved null block")
    weights = p.weight_bytes_per_device + -(-(p.draft_weight_bytes or 0) // tp)  # a draft model's too
    drafted = " with the draft model's" if p.draft_weight_bytes else ""
    if num_blocks < 1 and p.cache_budget_bytes > 0:
        raise ValueError(f"the KV cache budget left after the weights{drafted} ({p.cache_budget_bytes:,} bytes per "
                         f"device) holds no block of {config.block_size} tokens ({page:,} bytes) beside the engine's "
                         "reserved null block: lower --block-size")
    if num_blocks < 1:
        raise ValueError(f"{p.model} at tp {tp} on {dev.name}: the weights{drafted} ({weights / 1e9:.1f} GB "
                         f"per device) leave no room for a KV cache; raise --tp")
    if weights + (num_blocks + 1) * page > dev.memory_bytes:
        raise ValueError(f"{num_blocks:,} KV blocks ({(num_blocks + 1) * page / 2**30:.1f} GiB) and the weights"
                         f"{drafted} ({weights / 2**30:.1f} GiB) exceed {dev.name}'s "
                         f"{dev.memory_bytes / 2**30:.1f} GiB per device")


def step_cost(m: ModelConfig, p, dev, config: EngineConfig, model: str, tp: int, weight_dtype: str,
              efficiency: Efficiency | None) -> tuple[StepCost, str]:
    """The step cost and the weight dtype it prices: this CPU's cached calibration when it
    was fitted for these engine settings (then with the cost and the ceilings it was fitted
    on: weights as the engine stores them), else the config's cost on the plain roofline."""
    spec = m.kv_spec(p.kv_cache_dtype, config.block_size, tp, config.kv_cache_scale)
    cost, eff, w_dtype = config_cost(m, spec, p.weight_dtype, tp), efficiency or Efficiency(), p.weight_dtype
    calibration = cpu_calibration(config, model, tp) if dev.is_cpu and weight_dtype == config.weight_dtype else None
    if calibration is not None:  # on the ceilings it was fitted against
        eff, cost, w_dtype, dev = efficiency or calibration.efficiency, calibration.cost, config.weight_dtype, \
            calibration.on(dev)
    elif dev.is_cpu and efficiency is None:
        auto = (" (the planner's auto on the CPU; the engine's auto keeps a GGUF's blocks: --weight-dtype q4_1 or "
                "q8_0 prices those)") if weight_dtype == "auto" else ""
        eff = Efficiency(source=f"roofline: no calibration cached for this CPU and these settings (run pagedkv "
                                f"simulate --calibrate); weights priced as {p.weight_dtype}{auto}")
    return StepCost(cost, dev, p.weight_dtype, eff), w_dtype


def cpu_calibration(config: EngineConfig, model: str, tp: int):
    """This machine's cached calibration of ``model`` under ``config``'s dtypes
    (:class:`~pagedkv.sim.calibrate.Calibration`); None if there is none (or at ``tp`` > 1: it was one process)."""
    from pagedkv.sim.calibrate import cached

    return cached(config, model) if tp == 1 else None


def build_requests(workload: str | list[BenchRequest], num_prompts: int, request_rate: float | None, *,
                   max_prompt_tokens: int = 512, max_tokens: int = 128, input_len: int = 256,
                   output_len: int = 128, range_ratio: float = 0.0, max_model_len: int = 2048,
                   trace: str | None = None, seed: int = 0) -> list[BenchRequest]:
    """The requests of a workload name (or a list given as is), with Poisson arrivals at
    ``request_rate`` (``inf``: all at once). A trace keeps its own arrivals, and so does a
    list when ``request_rate`` is None (for a name, None is ``inf``).

    Raises:
        ValueError: an unknown workload, a bad rate or length, an unreadable or empty trace.
    """
    if request_rate is not None and (isinstance(request_rate, bool) or not isinstance(request_rate, (int, float))):
        raise ValueError(f"request rate must be a number of requests/s (or inf), got {brief(request_rate)}")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request rate must be positive (or inf), got {request_rate}")
    if trace is not None:
        if request_rate is not None:
            raise ValueError("a trace has its own arrival times: give a trace or a request rate, not both")
        return load_trace(trace, seed, max_model_len)
    if not isinstance(workload, list) and (isinstance(num_prompts, bool) or not isinstance(num_prompts, int)
                                           or num_prompts < 1):
        raise ValueError(f"num_prompts must be an integer >= 1, got {num_prompts!r}")
    if isinstance(workload, list):
        check_requests(workload)
        reqs = workload
    elif workload in SYNTHETIC:
        reqs = synthetic_workload(workload, num_prompts, input_len, output_len, range_ratio, max_model_len, seed)
    else:
        reqs = dataset_workload(workload, num_prompts, max_prompt_tokens, max_tokens, seed)
    if not reqs:
        raise ValueError("the workload has no requests")
    if request_rate is None:
        return list(reqs) if isinstance(workload, list) else with_poisson_arrivals(reqs, math.inf, seed)
    timed = with_poisson_arrivals(reqs, request_rate, seed)
    if not timed[-1].arrival_s <= MAX_ARRIVAL_S:
        raise ValueError(f"at {request_rate:g} req/s the last of {len(timed)} requests arrives after "
                         f"{timed[-1].arrival_s:.3g} s, past the simulator's {MAX_ARRIVAL_S:.0e} s (its clock "
                         "would lose sub-millisecond time): raise the request rate")
    return timed


@contextmanager
def _no_cycle_collection():
    """Pause the cyclic garbage collector (collecting once after). A run allocates a few
    objects per request and step and keeps many alive (requests, token lists, the step
    records), so the collector's periodic passes over the growing heap took ~30% of a
    10,000-request run; what a run allocates is freed by reference counting (no cycles:
    peak memory was the same with the collector off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
            gc.collect()


def run_setup(setup: SimSetup, requests: list[BenchRequest]) -> SimResult:
    """Drive ``requests`` through a fresh simulated engine of ``setup``."""
    engine = setup.engine()
    t0 = time.perf_counter()
    with _no_cycle_collection():
        run = drive(engine, requests, clock=engine.clock, sleep=engine.runner.sleep)
    wall = time.perf_counter() - t0
    events = len(run.steps) + 2 * len(requests)
    timeline = {"t_s": run.step_starts, "kv_blocks_used": run.blocks_used, "running": run.running_after,
                "waiting": run.waiting}
    settings = setup.settings | {"max_model_len": engine.max_model_len, "workload": workload_summary(requests)}
    metrics = run.metrics() | extra_metrics(run)
    if engine.scheduler.spec_stats is not None:  # the drafts as the scheduler counted them
        metrics["spec_decode"] = engine.scheduler.spec_stats.to_dict()
    if engine.connector is not None:  # the CPU tier's counters, as the engine's stats() gives them
        metrics["kv_offload"] = engine.connector.scheduler.get_stats()
    return SimResult(settings, metrics, timeline, wall,
                     events / wall if wall > 0 else math.inf, run)


def extra_metrics(run: EngineRun) -> dict:
    """Metrics the simulator adds to the benchmark's: mean KV blocks in use, and the
    normalized latency of the PagedAttention paper (mean over requests of end-to-end
    latency / output tokens, seconds per token)."""
    done = [r for r in run.records if r.token_times]
    return {"mean_kv_blocks": sum(run.blocks_used) / len(run.blocks_used) if run.blocks_used else 0.0,
            "normalized_latency_s": sum(r.e2e / r.num_output_tokens for r in done) / len(done) if done else None}


def simulate(model: str = "smollm2-135m-instruct", gpu: str = "cpu", tp: int = 1,
             workload: str | list[BenchRequest] | None = None, num_prompts: int | None = None,
             request_rate: float | None = None, *, weight_dtype: str = "auto", gpu_memory_utilization: float = 0.9,
             kv_cache_memory: int | str | None = None, efficiency: Efficiency | str | None = None,
             max_prompt_tokens: int = 512, max_tokens: int = 128, input_len: int = 256, output_len: int = 128,
             range_ratio: float = 0.0, trace: str | None = None, workload_seed: int = 0,
             spec_acceptance_rate: float | None = None, **engine_flags) -> SimResult:
    """Simulate serving ``workload`` with ``model`` on ``tp`` x ``gpu``.

    Args:
        model: a planner model (``pagedkv plan --list-models``) or a config.json path.
        gpu: a catalog GPU (``--list-gpus``) or ``cpu`` (this machine, measured).
        tp: tensor-parallel degree (each device holds 1/tp of weights, KV heads and FLOPs,
            and pays the planner's all-reduce time over the GPU link).
        workload: ``arena-hard``, ``hh-rlhf``, ``shared-prefix``, ``random``, ``sharegpt-like``,
            ``alpaca-like`` (:mod:`pagedkv.sim.workloads`), or a list of
            :class:`~pagedkv.bench.workloads.BenchRequest` (default: ``arena-hard``).
        num_prompts, request_rate: how many requests (default: 100), arriving as Poisson at this rate
            (requests/s; ``inf``: all at once; None: a list's own ``arrival_s``, else ``inf``).
        weight_dtype, gpu_memory_utilization, kv_cache_memory: as ``pagedkv plan``.
        efficiency: factors and overheads, or the name of a measured GPU fit or a JSON file
            of them (:func:`pagedkv.sim.gpu_fits.load_efficiency`; default: cached
            calibration on cpu, else roofline).
        max_prompt_tokens, max_tokens: the dataset workloads' prompt cap and output length.
        input_len, output_len, range_ratio: the ``random`` workload's lengths.
        trace: a JSONL trace (:func:`pagedkv.sim.workloads.load_trace`) instead of ``workload``
            (with its own arrivals: ``request_rate`` must then be None).
        workload_seed: seed of synthetic lengths, dataset draws, arrivals and accepted drafts.
        spec_acceptance_rate: with ``speculative_config``, the share of drafts the target
            accepts (accepted / drafted; :mod:`pagedkv.sim.spec`); required then.
        engine_flags: :class:`~pagedkv.config.engine.EngineConfig` fields (block_size, max_num_seqs, ...).

    Raises:
        ValueError: unknown model, GPU or workload; bad numbers; settings not simulated.
    """
    if trace is not None and (workload is not None or num_prompts is not None):
        raise ValueError("a trace replaces workload and num_prompts: give one or the other")
    workload = "arena-hard" if workload is None else workload
    num_prompts = 100 if num_prompts is None else num_prompts
    setup, requests = prepare(model, gpu, tp, engine_flags, weight_dtype, gpu_memory_utilization, kv_cache_memory,
                              efficiency, workload, num_prompts, request_rate,
                              dict(max_prompt_tokens=max_prompt_tokens, max_tokens=max_tokens, input_len=input_len,
                                   output_len=output_len, range_ratio=range_ratio, trace=trace, seed=workload_seed),
                              spec_acceptance_rate)
    result = run_setup(setup, requests)
    result.settings["request_rate"] = request_rate
    return result


def prepare(model: str, gpu: str, tp: int, engine_flags: dict, weight_dtype: str, gpu_memory_utilization: float,
            kv_cache_memory, efficiency: Efficiency | str | None, workload, num_prompts: int,
            request_rate: float | None,
            workload_kw: dict, spec_acceptance_rate: float | None = None) -> tuple[SimSetup, list[BenchRequest]]:
    """The setup and the requests of one simulation (the arguments as :func:`simulate`'s;
    ``workload_kw``: :func:`build_requests`' keywords but ``max_model_len``, which is the
    engine's, the cache's cap included). A weight dtype the engine knows is an engine flag too
    (part of a calibration's key)."""
    if weight_dtype in WEIGHT_DTYPES:
        engine_flags = engine_flags | {"weight_dtype": weight_dtype}
    if "tensor_parallel_size" in engine_flags:  # vLLM's name for tp
        engine_flags = dict(engine_flags)
        given = engine_flags.pop("tensor_parallel_size")
        if isinstance(given, bool) or not isinstance(given, int) or given < 1 or tp not in (1, given):
            raise ValueError(f"tensor_parallel_size {brief(given)} and tp {brief(tp)}: give one integer >= 1")
        tp = given
    setup = sim_setup(model, gpu, tp, engine_config(engine_flags), weight_dtype, gpu_memory_utilization,
                      kv_cache_memory, efficiency, spec_acceptance_rate, workload_kw.get("seed", 0))
    requests = build_requests(workload, num_prompts, request_rate, max_model_len=setup.engine().max_model_len,
                              **workload_kw)
    return setup, requests


def engine_config(flags: dict) -> EngineConfig:
    """:class:`EngineConfig` from engine flags.

    Raises:
        ValueError: a bad engine flag (the engine's own checks).
    """
    try:
        return EngineConfig(**flags)
    except TypeError as e:  # a keyword EngineConfig does not take
        cli = {k: v for k, v in CLI_NAMES.items() if k in flags}
        hint = "".join(f"; simulate() calls --{k.replace('_', '-')} {v}" for k, v in cli.items())
        raise ValueError(f"not an engine setting: {e}{hint}") from None


#: CLI flags whose simulate() keyword has another name
CLI_NAMES = {"random_input_len": "input_len", "random_output_len": "output_len", "random_range_ratio": "range_ratio"}
