"""The benchmark commands: ``throughput``, ``online``, ``capacity``, ``latency``.

Each builds one workload, measures the machine once (read bandwidth, fp32 matmul rate),
then runs every system once per repeat, systems back to back inside a repeat so a ratio
compares runs that shared the machine's weather. Systems:

- ``pagedkv``: the engine as configured (paged allocator);
- ``contiguous``: the same engine with ``kv_allocator="contiguous"`` (reserves prompt +
  max_tokens slots per request at admission);
- ``hf``, ``hf-cb``, ``llama-cpp``: see :mod:`pagedkv.bench.baselines`.

A fresh engine is built for every run (pages and prefix cache start empty) and warmed up
with one tiny request before the clock starts.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.bench import baselines, report
from pagedkv.bench.driver import drive, warm_up
from pagedkv.bench.load import LoadMeter
from pagedkv.bench.roofline import Machine, as_float32, model_cost
from pagedkv.bench.workloads import BenchRequest, build_workload, with_poisson_arrivals, workload_summary
from pagedkv.config.engine import EngineConfig
from pagedkv.planner.roofline import ModelCost, bound, ideal_offline_steps

ENGINE_SYSTEMS = {"pagedkv": "paged", "contiguous": "contiguous"}
SYSTEMS = ("pagedkv", "contiguous", "hf", "hf-cb", "llama-cpp")


@dataclass
class Settings:
    """What to run. ``engine`` holds :class:`EngineConfig` keyword arguments."""
    engine: dict
    systems: tuple[str, ...] = ("pagedkv", "contiguous", "hf")
    dataset: str = "arena-hard"
    num_prompts: int = 64
    max_prompt_tokens: int = 512
    max_tokens: int = 128
    ignore_eos: bool = True
    request_rate: float = float("inf")
    repeats: int = 1
    hf_batch_size: int = 16
    seed: int = 0
    progress: bool = True
    quick_machine: bool = False
    checkpoint: Path | None = None

    def to_dict(self) -> dict:
        def plain(v):
            if isinstance(v, float) and v == float("inf"):
                return "inf"
            return str(v) if isinstance(v, Path) else v
        return {k: plain(v) for k, v in self.__dict__.items()}


@dataclass
class Context:
    """Things measured or loaded once per command."""
    settings: Settings
    machine: Machine
    files: object
    tokenizer: object
    cost: ModelCost | None = None        # the engine's model, as configured (--weight-dtype)
    fp32_cost: ModelCost | None = None   # the same model read in fp32 (the HF baselines)
    hf_model: object = None
    series: dict = field(default_factory=dict)
    loadavg_start: tuple = field(default_factory=os.getloadavg)
    probes: list = field(default_factory=list)
    deferred: list = field(default_factory=list)

    def probe(self, label: str) -> None:
        """Measure the ceilings again (before a run); keep the best seen."""
        m = Machine.measure("quick" if self.settings.quick_machine else "probe")
        self.probes.append({"before": label, "read_bandwidth": m.read_bandwidth, "fp32_flops": m.fp32_flops,
                            "int8_ops": m.int8_ops})
        self.machine = self.machine.best(m)

    def cost_for(self, system: str) -> ModelCost:
        """The bytes and FLOPs ``system`` pays: HF baselines read fp32 weights."""
        return self.fp32_cost if system in ("hf", "hf-cb") and self.fp32_cost is not None else self.cost

    def roofline(self, run: dict, fn) -> None:
        """Set ``run["roofline"] = fn()`` now and again at the end, against the final ceilings."""
        run["roofline"] = fn()
        self.deferred.append((run, fn))

    def machine_info(self) -> dict:
        """Measured ceilings, threads, and the 1-minute load average before and after (other
        processes on a shared machine show up there)."""
        return self.machine.to_dict() | {"cpus": os.cpu_count(), "torch_threads": _threads(),
                                         "MKL_CBWR": os.environ.get("MKL_CBWR"),
                                         "loadavg_1min_start": self.loadavg_start[0],
                                         "loadavg_1min_end": os.getloadavg()[0], "probes": self.probes}


def make_context(settings: Settings) -> Context:
    from pagedkv.model.loader import load_tokenizer, resolve_model

    files = resolve_model(settings.engine.get("model") or "smollm2-135m-instruct")
    return Context(settings, Machine.measure("quick" if settings.quick_machine else "full"), files,
                   load_tokenizer(files.folder))


def _bar(ctx: Context, desc: str, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False,
                disable=not ctx.settings.progress)


def _progress(bar):
    def update(done: int, total: int) -> None:
        bar.n = done
        bar.refresh()
    return update


def make_engine(ctx: Context, **overrides):
    from pagedkv.config.engine import EngineConfig
    from pagedkv.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(**(ctx.settings.engine | overrides)))
    if ctx.cost is None:
        ctx.cost = model_cost(engine)
        ctx.fp32_cost = as_float32(ctx.cost, engine)
    warm_up(engine)
    return engine


def run_engine_system(ctx: Context, system: str, workload: list[BenchRequest], **overrides) -> tuple[dict, object]:
    """One run of the engine (``pagedkv`` or ``contiguous``); returns ``(metrics, run)``."""
    engine = make_engine(ctx, kv_allocator=ENGINE_SYSTEMS[system], **overrides)
    with _bar(ctx, system, len(workload)) as bar:
        run = drive(engine, workload, ctx.settings.ignore_eos, on_step=_progress(bar))
    del engine
    gc.collect()
    return run.metrics(), run


def run_baseline(ctx: Context, system: str, workload: list[BenchRequest]) -> tuple[dict, list | None]:
    """One run of a baseline; returns ``(metrics, steps or None)``."""
    from pagedkv.bench.metrics import summarize_requests

    with _bar(ctx, system, len(workload)) as bar:
        if system == "llama-cpp":
            recs, steps, dur, extra = baselines.run_llama_cpp(_gguf_for(ctx), workload, _threads(), _progress(bar))
        else:
            if ctx.hf_model is None:
                ctx.hf_model = baselines.load_hf_model(ctx.files.folder)
            if system == "hf":
                pad = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else 0
                recs, steps, dur, extra = baselines.run_hf_static(ctx.hf_model, workload, ctx.settings.hf_batch_size,
                                                                  pad, _progress(bar))
            else:
                recs, steps, dur, extra = baselines.run_hf_continuous(
                    ctx.hf_model, workload, ctx.settings.engine.get("max_num_batched_tokens", 2048), _progress(bar))
    return summarize_requests(recs, dur) | extra, steps


def _llama_cpp_one_at_a_time(ctx: Context, workload: list[BenchRequest]) -> dict:
    """llama.cpp's metrics with each request run alone (a single stream), as ``latency`` runs pagedkv."""
    from pagedkv.bench.metrics import summarize_requests

    records, extra = [], {}
    for request in workload:
        recs, _, _, extra = baselines.run_llama_cpp(_gguf_for(ctx), [request], _threads())
        records += recs
    return summarize_requests(records, sum(r.e2e for r in records)) | extra


def _gguf_for(ctx: Context):
    """The GGUF file llama.cpp runs: the model's own, or the bundled model's."""
    return ctx.files.name if str(ctx.files.name).endswith(".gguf") else _bundled_gguf(ctx)


def _bundled_gguf(ctx: Context):
    from pagedkv.model.loader import KNOWN_MODELS, _packaged_gguf

    name = str(ctx.files.name).lower()
    if name not in KNOWN_MODELS:
        raise baselines.BaselineUnavailable(f"no GGUF file known for model {ctx.files.name!r}")
    return _packaged_gguf(name)


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def roofline_entry(ctx: Context, metrics: dict, steps, workload: list[BenchRequest], ideal: bool,
                   system: str = "pagedkv") -> dict:
    """Bound of the run's own schedule (when known) and of the ideal offline batch."""
    out: dict = {}
    cost = ctx.cost_for(system)
    dur, toks = metrics["duration_s"], metrics["output_tokens"]
    # W8A8 runs its products on the int8 units; weight-only formats and baselines in fp32
    compute = "int8" if system == "pagedkv" and ctx.settings.engine.get("activation_dtype") == "int8" else "float32"
    if steps:
        b = bound(steps, cost, ctx.machine, compute)
        out |= {"bound_s": b["bound_s"], "fraction": b["bound_s"] / dur, "limited_by": b["limited_by"],
                "seconds_by_limit": b["seconds_by_limit"], "bound_output_tokens_per_s": toks / b["bound_s"]}
    if ideal:
        b = bound(ideal_offline_steps([r.num_prompt_tokens for r in workload], [r.output_len for r in workload]),
                  cost, ctx.machine, compute)
        out |= {"ideal_bound_s": b["bound_s"], "fraction_of_ideal": b["bound_s"] / dur,
                "ideal_limited_by": b["limited_by"], "ideal_output_tokens_per_s": toks / b["bound_s"]}
        out.setdefault("bound_output_tokens_per_s", out["ideal_output_tokens_per_s"])
    return out


def run_systems(ctx: Context, command: str, workload: list[BenchRequest], ideal: bool) -> dict:
    """Every system, every repeat; the result document with runs, skips and medians."""
    s = ctx.settings
    result = report.new_result(command, s.to_dict())
    result["workload"] = {"dataset": s.dataset} | workload_summary(workload)
    for rep in range(s.repeats):
        for system in s.systems:
            if system in result["skipped"]:
                continue
            try:
                ctx.probe(f"{system} repeat {rep}")
                with LoadMeter() as load:
                    metrics, steps = _one(ctx, system, workload)
            except baselines.BaselineUnavailable as e:
                result["skipped"][system] = str(e)
                continue
            except Exception as e:  # noqa: BLE001 - a failing baseline must not lose the other runs
                if system in ENGINE_SYSTEMS:
                    raise
                result["skipped"][system] = f"failed: {type(e).__name__}: {e}"
                continue
            run = {"system": system, "repeat": rep, "metrics": metrics, "load": load.result()}
            ctx.roofline(run, lambda m=metrics, st=steps, sy=system: roofline_entry(ctx, m, st, workload, ideal, sy))
            result["runs"].append(run)
            checkpoint(ctx, result)
    return finish(ctx, result)


def finish(ctx: Context, result: dict, best_key: str = "metrics.output_tokens_per_s", higher: bool = True) -> dict:
    """Rooflines against the final ceilings; machine, model and series sections; the
    medians over repeats and the best runs."""
    for run, fn in ctx.deferred:
        run["roofline"] = fn()
    result["machine"] = ctx.machine_info()
    result["model"] = {"name": str(ctx.files.name), "cost": ctx.cost.to_dict() if ctx.cost else None,
                       "weight_dtype": ctx.settings.engine.get("weight_dtype", EngineConfig.weight_dtype),
                       "activation_dtype": ctx.settings.engine.get("activation_dtype", EngineConfig.activation_dtype)}
    result["series"] = ctx.series
    report.summarize(result, best_key, higher)
    return result


def checkpoint(ctx: Context, result: dict) -> None:
    """Write the runs so far to ``settings.checkpoint`` (marked ``"complete": false``), so a
    long run that is stopped keeps what it measured; the final write replaces it."""
    if ctx.settings.checkpoint is not None:
        report.write_json(finish(ctx, dict(result, summary={})) | {"complete": False}, ctx.settings.checkpoint)


def _one(ctx: Context, system: str, workload: list[BenchRequest]) -> tuple[dict, list | None]:
    if system in ENGINE_SYSTEMS:
        metrics, run = run_engine_system(ctx, system, workload)
        ctx.series[system] = {"waste": [1 - f / a if a else 0.0 for a, f in zip(run.waste.allocated, run.waste.filled)],
                              "running": run.running, "blocks_used": run.blocks_used}
        return metrics, run.steps
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    if ctx.cost is None:  # the roofline needs the model's cost; one engine build gives it
        make_engine(ctx, num_blocks=16)
    return run_baseline(ctx, system, workload)


# ---- commands ---------------------------------------------------------------------------
def workload_for(ctx: Context) -> list[BenchRequest]:
    s = ctx.settings
    w = build_workload(s.dataset, ctx.tokenizer, s.num_prompts, s.max_prompt_tokens, s.max_tokens, s.seed)
    return with_poisson_arrivals(w, s.request_rate, s.seed) if s.request_rate != float("inf") else w


def throughput(settings: Settings) -> dict:
    """Offline (all at once) unless a request rate is set; with the throughput goals for the
    engine vs HF (BENCHMARKS.md)."""
    ctx = make_context(settings)
    result = run_systems(ctx, "throughput", workload_for(ctx), ideal=settings.request_rate == float("inf"))
    key = "metrics.output_tokens_per_s"
    for base in ("contiguous", "hf", "hf-cb", "llama-cpp"):
        if any(r["system"] == base for r in result["runs"]):
            report.add_ratio(result, f"pagedkv/{base} output tok/s", "pagedkv", base, key)
    if "pagedkv/hf output tok/s" in result["ratios"]:
        r = result["ratios"]["pagedkv/hf output tok/s"]
        report.add_goal(result, "output tok/s vs HF static batching", r["median"], 4.0, best=r["best_of_each"])
    pk = result["summary"].get("pagedkv", {})
    if "roofline.fraction_of_ideal" in pk:
        report.add_goal(result, "fraction of the roofline (ideal offline batch)", pk["roofline.fraction_of_ideal"], 0.5,
                        best=result["best"].get("pagedkv", {}).get("roofline.fraction_of_ideal"))
    return result


def online(settings: Settings) -> dict:
    """Poisson arrivals at ``request_rate``, engines only (a static batch cannot take arrivals)."""
    if settings.request_rate == float("inf"):
        raise ValueError("online needs a finite --request-rate (requests per second)")
    settings.systems = tuple(s for s in settings.systems if s in ENGINE_SYSTEMS) or ("pagedkv",)
    ctx = make_context(settings)
    return run_systems(ctx, "online", workload_for(ctx), ideal=False)


def capacity(settings: Settings) -> dict:
    """Paged vs contiguous at a fixed KV budget: waste and requests running at once."""
    settings.systems = ("pagedkv", "contiguous")
    ctx = make_context(settings)
    result = run_systems(ctx, "capacity", workload_for(ctx), ideal=False)
    pk, ct = result["summary"].get("pagedkv", {}), result["summary"].get("contiguous", {})
    report.add_goal(result, "paged KV memory waste", pk.get("metrics.waste"), 0.05, higher_is_better=False,
                    note=f"contiguous allocator: {100 * (ct.get('metrics.waste') or 0):.1f}%")
    ratio = report.add_ratio(result, "pagedkv/contiguous max running", "pagedkv", "contiguous", "metrics.max_running")
    report.add_goal(result, "requests running at once vs contiguous", ratio, 2.0)
    report.add_ratio(result, "pagedkv/contiguous output tok/s", "pagedkv", "contiguous", "metrics.output_tokens_per_s")
    return result


def latency(settings: Settings) -> dict:
    """Single-stream decode, one request at a time: TPOT against the weight-read bound
    (weight bytes / measured read bandwidth per token)."""
    from pagedkv.bench.metrics import summarize_requests
    from pagedkv.planner.roofline import weight_read_tokens_per_s

    settings.systems = tuple(s for s in settings.systems if s in ("pagedkv", "hf", "llama-cpp")) or ("pagedkv",)
    settings.hf_batch_size = 1
    ctx = make_context(settings)
    workload = workload_for(ctx)
    result = report.new_result("latency", settings.to_dict())
    result["workload"] = {"dataset": settings.dataset} | workload_summary(workload)
    for rep in range(settings.repeats):
        for system in settings.systems:
            if system in result["skipped"]:
                continue
            ctx.probe(f"{system} repeat {rep}")
            with LoadMeter() as load:
                if system == "pagedkv":
                    engine = make_engine(ctx)
                    records = [rec for r in workload for rec in drive(engine, [r], settings.ignore_eos).records]
                    metrics = summarize_requests(records, sum(r.e2e for r in records))
                    del engine
                else:
                    try:
                        metrics = (_llama_cpp_one_at_a_time(ctx, workload) if system == "llama-cpp"
                                   else _one(ctx, system, workload)[0])
                    except baselines.BaselineUnavailable as e:
                        result["skipped"][system] = str(e)
                        continue
            tps = 1 / metrics["tpot_s"]["p50"]
            metrics["decode_tokens_per_s"] = tps
            run = {"system": system, "repeat": rep, "metrics": metrics, "load": load.result()}

            def weight_read(tps=tps, system=system):
                bound_tps = weight_read_tokens_per_s(ctx.cost_for(system), ctx.machine)
                return {"weight_read_tokens_per_s": bound_tps, "fraction_of_weight_read": tps / bound_tps}
            ctx.roofline(run, weight_read)
            result["runs"].append(run)
            checkpoint(ctx, result)
    finish(ctx, result, "metrics.decode_tokens_per_s")
    report.add_goal(result, "single-stream decode vs weight-read bound",
                    result["summary"]["pagedkv"].get("roofline.fraction_of_weight_read"), 0.8,
                    best=result["best"].get("pagedkv", {}).get("roofline.fraction_of_weight_read"))
    if "hf" in result["summary"]:
        report.add_ratio(result, "pagedkv/hf decode tok/s", "pagedkv", "hf", "metrics.decode_tokens_per_s")
    if "llama-cpp" in result["summary"]:
        ratio = report.add_ratio(result, "pagedkv/llama-cpp decode tok/s", "pagedkv", "llama-cpp",
                                 "metrics.decode_tokens_per_s")
        report.add_goal(result, "single-stream decode vs llama.cpp", ratio, 1.0)
    return result
