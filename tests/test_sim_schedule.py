"""The simulator runs the engine's own scheduler: with the same step times it makes the
same schedule as the real engine, step for step (admissions, chunks, preemptions, pages)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace

import pytest

from pagedkv.bench.driver import drive
from pagedkv.bench.workloads import BenchRequest, with_poisson_arrivals
from pagedkv.config.engine import EngineConfig
from pagedkv.connectors.offload import disk_tier as disk_offload
from pagedkv.core.kv_eviction import eviction_policy
from pagedkv.engine.engine import LLMEngine
from pagedkv.model.config import for_engine
from pagedkv.model.hf_config import load_config
from pagedkv.planner.roofline import config_cost
from pagedkv.sim.clock import VirtualClock
from pagedkv.sim.engine import SimEngine
from pagedkv.sim.runner import RecordedTimes, SimRunner, fixed_times
from pagedkv.sim.tier import TierCosts, sim_tier_worker

STEP_S = 0.01


def workload(n: int = 12, rate: float = 40.0) -> list[BenchRequest]:
    """Distinct prompts of 5..38 tokens and 3..17 outputs, Poisson arrivals."""
    reqs = [BenchRequest(tuple(range(10 * i + 1, 10 * i + 6 + (7 * i) % 34)), 3 + (5 * i) % 15, 3 + (5 * i) % 15)
            for i in range(n)]
    return with_poisson_arrivals(reqs, rate, seed=1)


def flags(**kw) -> dict:
    return dict(num_blocks=14, block_size=4, max_num_batched_tokens=24, max_num_seqs=6,
                debug_invariants=True) | kw


def schedule_log(engine) -> list:
    """Wrap ``engine.scheduler.schedule`` to record each step as plain, comparable data."""
    sched, log = engine.scheduler, []
    inner = sched.schedule

    def recording():
        out = inner()
        c = out.scheduled_cached_reqs
        log.append(([(r.req_id, len(r.token_ids), r.block_ids, r.num_computed_tokens, r.resumed)
                     for r in out.scheduled_new_reqs],
                    list(zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, c.kept_blocks)),
                    dict(out.num_scheduled_tokens), list(out.preempted_req_ids), list(out.finished_req_ids)))
        return out

    sched.schedule = recording
    return log


class FixedTimeRunner:
    """The real model runner, with each step taking ``STEP_S`` on a virtual clock."""

    def __init__(self, inner, clock: VirtualClock) -> None:
        self.inner, self.clock = inner, clock

    def execute(self, out):
        result = self.inner.execute(out)
        if out.num_scheduled_tokens:
            self.clock.advance(STEP_S)
            result.execute_seconds = STEP_S
        return result


def sim_engine(model_dir, config: EngineConfig, runner: SimRunner, clock: VirtualClock) -> SimEngine:
    m = for_engine(load_config(model_dir / "config.json"))
    cost = config_cost(m, m.kv_spec("float32", config.block_size), "float32")
    return SimEngine(config, m, config.num_blocks, cost, runner, clock)


def tier_worker(model_dir, config: EngineConfig):
    """The simulated tiers' worker (None without a tier): copies take no time, as
    FixedTimeRunner's real ones."""
    page = for_engine(load_config(model_dir / "config.json")).kv_spec("float32", config.block_size).page_size_bytes
    return sim_tier_worker(config, TierCosts(page, float("inf")))


def run_real(model_dir, work, virtual: bool, **kw):
    engine = LLMEngine(EngineConfig(model=str(model_dir), **flags(**kw)))
    log = schedule_log(engine)
    if virtual:
        clock = VirtualClock()
        engine.core.clock = clock
        engine.core.runner = FixedTimeRunner(engine.core.runner, clock)
        run = drive(engine, work, clock=clock, sleep=clock.sleep)
    else:
        run = drive(engine, work)
    return run, log, engine


def run_sim(model_dir, work, replay=None, **kw):
    clock = VirtualClock()
    config = EngineConfig(model="unused", **flags(**kw))
    tier = tier_worker(model_dir, config)
    runner = (SimRunner(clock, fixed_times(STEP_S), eviction=eviction_policy(config), tier=tier) if replay is None
              else SimRunner(clock, replay=RecordedTimes.of(replay), tier=tier))
    engine = sim_engine(model_dir, config, runner, clock)
    log = schedule_log(engine)
    return drive(engine, work, clock=clock, sleep=runner.sleep), log, engine


EVICT = dict(kv_budget_tokens=12, kv_window_tokens=4, num_sink_tokens=2, num_blocks=16)
TIER = 64 * 1024  # bytes: 32 pages of the tiny model's 2 KiB


@pytest.mark.parametrize("kw", [{}, {"enable_prefix_caching": False, "max_num_batched_tokens": 16},
                                {"kv_allocator": "contiguous", "num_blocks": 40},
                                {"kv_eviction": "snapkv"} | EVICT, {"kv_eviction": "h2o"} | EVICT,
                                {"kv_offload_memory": TIER}, {"kv_offload_memory": TIER, "preemption_mode": "swap"}])
def test_same_schedule_as_the_engine_with_fixed_step_times(tiny_model_dir, kw):
    """SnapKV/H2O: the engine keeps the tokens its scores pick, the simulator as many of
    others; pages, compactions and the schedule they make are the same. The CPU tier: the
    engine's own tier bookkeeping, its loads, saves and swaps planned alike."""
    work = workload()
    real, real_log, _ = run_real(tiny_model_dir, work, virtual=True, **kw)
    sim, sim_log, _ = run_sim(tiny_model_dir, work, **kw)
    assert real.preemptions > 0 or kw.get("kv_allocator") == "contiguous" or "kv_eviction" in kw  # a tight pool
    assert sim_log == real_log
    assert (sim.preemptions, max(sim.blocks_used)) == (real.preemptions, max(real.blocks_used))
    for a, b in zip(sorted(sim.records, key=lambda r: r.index), sorted(real.records, key=lambda r: r.index)):
        assert (a.index, a.num_output_tokens, a.num_preemptions) == (b.index, b.num_output_tokens, b.num_preemptions)
        assert a.token_times == pytest.approx(b.token_times)
        assert a.arrival == pytest.approx(b.arrival)


def test_same_schedule_at_block_boundaries(tiny_model_dir):
    """Prompts of 1, 15, 16 and 17 tokens in 16-token blocks, outputs crossing a block edge,
    a pool of 4 blocks (preemptions), requests ended early by the driver (aborts)."""
    lens = [1, 15, 16, 17, 15, 16, 17, 1]
    work = with_poisson_arrivals([BenchRequest(tuple(range(100 * i + 1, 100 * i + 1 + n)), 10 + i % 3, 18)
                                  for i, n in enumerate(lens)], 1000.0, seed=2)
    kw = dict(num_blocks=4, block_size=16, max_num_batched_tokens=32)
    real, real_log, _ = run_real(tiny_model_dir, work, virtual=True, **kw)
    sim, sim_log, _ = run_sim(tiny_model_dir, work, **kw)
    assert real.preemptions > 0 and sim_log == real_log
    assert [r.num_output_tokens for r in sorted(sim.records, key=lambda r: r.index)] == [10 + i % 3 for i in range(8)]


def test_replaying_a_wall_clock_run_gives_its_schedule(tiny_model_dir):
    """The real engine on the wall clock; the simulator with the clock set to the recorded
    step starts makes the same steps, preemptions and peak blocks."""
    work = workload(rate=200.0)
    real, real_log, _ = run_real(tiny_model_dir, work, virtual=False)
    sim, sim_log, _ = run_sim(tiny_model_dir, work, replay=real)
    assert real.preemptions > 0
    assert sim_log == real_log
    assert (sim.preemptions, max(sim.blocks_used), len(sim.steps)) == (real.preemptions, max(real.blocks_used),
                                                                       len(real.steps))


def test_replayed_token_times_skip_the_idle_waits(tiny_model_dir):
    """At a low rate the engine idles between requests. A replay stamps each request's
    tokens when the real run did (up to the driver's bookkeeping between steps), not after
    the next idle wait: its e2e latencies match the real ones."""
    work = workload(n=8, rate=1.0)  # ~1 s between arrivals: idle even on a loaded machine
    # each ends by the driver's abort (output_len < max_tokens), after the step's counts are taken
    work = [replace(r, max_tokens=r.max_tokens + 6) for r in work]
    real, _, _ = run_real(tiny_model_dir, work, virtual=False)
    sim, _, _ = run_sim(tiny_model_dir, work, replay=real)
    starts, secs = real.step_starts, real.step_seconds
    idle = sum(starts[i + 1] - starts[i] - secs[i] for i in range(len(starts) - 1) if real.idle_after[i])
    assert idle > 0.2  # seconds the engine waited for arrivals
    e2e = [sum(r.token_times[-1] - r.arrival for r in run.records) for run in (real, sim)]
    # summed over requests: stamped after the waits, a replay was late by at least the idle time
    assert abs(e2e[1] - e2e[0]) < idle / 2


def test_a_schedule_that_ignores_arrivals_would_differ(tiny_model_dir):
    """The check has teeth: the same workload all at once schedules differently."""
    work = workload()
    _, real_log, _ = run_real(tiny_model_dir, work, virtual=True)
    burst = [BenchRequest(r.prompt_token_ids, r.output_len, r.max_tokens) for r in work]
    _, sim_log, _ = run_sim(tiny_model_dir, burst)
    assert sim_log != real_log


class InlineExecutor:
    """Runs each submitted call at once: the disk tier's writer thread made deterministic,
    so a write ends in the step that queued it (the simulator's, at infinite rates, too)."""

    def submit(self, fn, *args):
        f = Future()
        try:
            f.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - handed back as the real executor would
            f.set_exception(e)
        return f

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_same_schedule_with_the_disk_tier(tiny_model_dir, tmp_path, monkeypatch):
    """A CPU tier of 6 pages in front of a disk tier: blocks the CPU tier evicts come back
    from disk after preemptions. The engine's own disk bookkeeping in the simulator plans
    the same writes, lookups and loads as the real engine (which wrote real records)."""
    monkeypatch.setattr(disk_offload, "ThreadPoolExecutor", lambda **kw: InlineExecutor())
    kw = dict(kv_offload_memory=6 * 2048, kv_offload_dir=str(tmp_path), kv_offload_disk_size="1MiB")
    first = workload()[:6]
    work = with_poisson_arrivals(list(first) + [BenchRequest(r.prompt_token_ids, r.output_len, r.max_tokens)
                                                for r in first], 40.0, seed=1)  # each prompt twice
    real, real_log, real_engine = run_real(tiny_model_dir, work, virtual=True, **kw)
    sim, sim_log, sim_engine_ = run_sim(tiny_model_dir, work, **kw)
    real_stats = real_engine.stats().kv_offload
    sim_stats = sim_engine_.connector.scheduler.get_stats()
    assert real.preemptions > 0 and real_stats["disk_blocks_loaded"] > 0 and real_stats["disk_blocks_written"] > 0
    assert any(tmp_path.iterdir())  # the real engine's records; the simulator's directory holds none of its own
    assert sim_log == real_log
    for name in ("hit_tokens", "disk_hit_tokens", "disk_blocks_loaded", "disk_blocks_written", "blocks_saved",
                 "evictions", "disk_blocks_used"):
        assert sim_stats[name] == real_stats[name], name
