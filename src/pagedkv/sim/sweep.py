"""``pagedkv simulate --sweep``: the highest request rate that meets a latency target.

The same requests (same lengths and seed) are simulated at Poisson rates found by
doubling from ``start`` until the target is missed (or, where ``start`` misses it, halving
until it is met, at most :data:`MAX_HALVINGS` times), then bisecting between the last rate
that met it and the first that did not, :data:`BISECT_STEPS` times (a queue that never
drains makes latency grow with the run's length, so "meets" is a property of this
workload's size, as in the PagedAttention paper's figure 12, where the number of requests
is fixed). Targets: ``normalized_latency`` (mean seconds per output token, the paper's)
or a percentile of TTFT, TPOT or end-to-end latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pagedkv.bench.workloads import BenchRequest, with_poisson_arrivals
from pagedkv.sim.workloads import MAX_ARRIVAL_S

TARGETS = ("normalized_latency", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99",
           "e2e_p50", "e2e_p90", "e2e_p99")
BISECT_STEPS = 6
MAX_DOUBLINGS = 20
MAX_HALVINGS = 12  # down to start / 4096: from 0.5 req/s, one request every ~2.3 hours


def target_value(metrics: dict, target: str) -> float | None:
    """The metric ``target`` names (seconds), from a result's metrics."""
    if target == "normalized_latency":
        return metrics["normalized_latency_s"]
    name, pct = target.rsplit("_", 1)
    return metrics[f"{name}_s"][pct]


@dataclass
class SweepPoint:
    rate: float
    value: float | None
    meets: bool
    metrics: dict


def sweep(run: Callable[[list[BenchRequest]], dict], requests: list[BenchRequest], target: str, limit: float,
          start: float = 0.5, seed: int = 0) -> tuple[float | None, list[SweepPoint]]:
    """The highest rate (requests/s) whose run meets ``value <= limit``, and every point tried.

    ``run(requests)`` simulates and returns metrics. Returns ``None`` for the rate when
    even ``start / 2**MAX_HALVINGS`` misses the target.

    Raises:
        ValueError: an unknown target, a limit or start that is not positive.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown latency target {target!r}; choose from {', '.join(TARGETS)}")
    if not limit > 0 or not start > 0:
        raise ValueError(f"the target and the starting rate must be positive, got {limit} and {start}")
    points: list[SweepPoint] = []

    def at(rate: float) -> bool:
        m = run(with_poisson_arrivals(requests, rate, seed))
        v = target_value(m, target)
        if v is None:
            raise ValueError(f"{target} is undefined for these requests (TPOT needs 2 or more output tokens)")
        points.append(SweepPoint(rate, v, v is not None and v <= limit, m))
        return points[-1].meets

    good, bad, rate = None, None, start
    for _ in range(MAX_DOUBLINGS):
        if not at(rate):
            bad = rate
            break
        good, rate = rate, rate * 2
    if good is None:  # even start misses: halve until a rate meets the target
        for _ in range(MAX_HALVINGS):
            rate /= 2
            if len(requests) / rate > MAX_ARRIVAL_S / 10:  # the last arrival near the clock's limit
                break
            if at(rate):
                good = rate
                break
            bad = rate
    if good is None or bad is None:
        return good, points
    for _ in range(BISECT_STEPS):
        mid = (good + bad) / 2
        good, bad = (mid, bad) if at(mid) else (good, mid)
    return good, points
