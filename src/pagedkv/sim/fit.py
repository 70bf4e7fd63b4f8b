"""Fit the cost model's efficiency factors and overheads to measured steps.

Each sample is one real engine step: its roofline terms ``memory_s`` and ``compute_s``
(:meth:`pagedkv.sim.cost.StepCost.terms`), the requests in it and the seconds it took.
The model (:class:`~pagedkv.sim.cost.Efficiency`)::

    seconds = max(memory_s / memory, compute_s / compute) + step_overhead_s + request_overhead_s * requests

is fitted by minimizing the squared *relative* error (step times span three orders of
magnitude, from a 1-token decode to a 2,048-token prefill): a grid over the two
efficiencies (log-spaced, then refined around the best), and for each point the two
overheads by non-negative least squares, which is exact for two unknowns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GRID = np.geomspace(0.02, 1.5, 48)


@dataclass(frozen=True)
class Fit:
    """Fitted factors and how well they explain the samples (relative errors)."""
    memory: float
    compute: float
    step_overhead_s: float
    request_overhead_s: float
    median_abs_rel_error: float
    max_abs_rel_error: float
    samples: int


def _overheads(x: np.ndarray, n: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    """Non-negative (o, r) minimizing sum(((x + o + r n - t) / t)^2); returns (o, r, loss)."""
    w = 1.0 / t
    y = (t - x) * w
    a = np.stack([w, n * w], axis=1)
    best = None
    candidates = [np.linalg.lstsq(a, y, rcond=None)[0]]
    for j in (0, 1):  # one overhead at zero: the other from a one-column fit
        col = a[:, 1 - j]
        v = max(0.0, float(col @ y / (col @ col))) if col @ col > 0 else 0.0
        candidates.append(np.array([0.0, v] if j == 0 else [v, 0.0]))
    candidates.append(np.zeros(2))
    for c in candidates:
        if (c >= 0).all():
            loss = float(((a @ c - y) ** 2).sum())
            if best is None or loss < best[2]:
                best = (float(c[0]), float(c[1]), loss)
    return best


def fit(memory_s, compute_s, requests, seconds) -> Fit:
    """Fit the factors to samples (equal-length sequences; seconds > 0).

    Raises:
        ValueError: fewer than 4 samples, or a non-positive time.
    """
    m, c, n, t = (np.asarray(v, dtype=np.float64) for v in (memory_s, compute_s, requests, seconds))
    if len(t) < 4 or not (t > 0).all():
        raise ValueError(f"a fit needs at least 4 steps with positive times, got {len(t)}")
    best = _search(m, c, n, t, GRID, GRID)
    step = GRID[1] / GRID[0]
    fine_m = np.geomspace(best[0] / step, min(1.5, best[0] * step), 15)
    fine_c = np.geomspace(best[1] / step, min(1.5, best[1] * step), 15)
    em, ec, o, r, _ = _search(m, c, n, t, fine_m, fine_c)
    err = np.abs((np.maximum(m / em, c / ec) + o + r * n - t) / t)
    return Fit(em, ec, o, r, float(np.median(err)), float(err.max()), len(t))


def _search(m, c, n, t, mems, comps) -> tuple[float, float, float, float, float]:
    best = None
    for em in mems:
        for ec in comps:
            o, r, loss = _overheads(np.maximum(m / em, c / ec), n, t)
            if best is None or loss < best[4]:
                best = (float(em), float(ec), o, r, loss)
    return best
