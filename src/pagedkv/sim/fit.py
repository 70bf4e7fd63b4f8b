"""Fit the cost model's efficiency factors and overheads to measured steps.

Each sample is one real engine step: its four roofline terms (:meth:`pagedkv.sim.cost.StepCost.phases`:
weights, matmul, KV and attention seconds), the requests in it and the seconds it took.
The model (:class:`~pagedkv.sim.cost.Efficiency` with an attention phase)::

    seconds = max(weights_s / memory, matmul_s / compute) + kv_s / kv_read + attention_s / attention
              + step_overhead_s + request_overhead_s * requests

is fitted by minimizing the squared *relative* error (step times span three orders of
magnitude, from a 1-token decode to a 2,048-token prefill): a grid over ``memory`` and
``compute`` (log-spaced, then refined around the best), and at each point the four
linear coefficients (``1 / kv_read``, ``1 / attention`` and the two overheads) by
non-negative least squares, exact for so few unknowns (every subset of columns is tried).
A coefficient under ``1 / 1.5`` is read as efficiency 1.5 (the cap).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

GRID = np.geomspace(0.02, 1.5, 40)
MAX_EFFICIENCY = 1.5


@dataclass(frozen=True)
class Fit:
    """Fitted factors and how well they explain the samples (relative errors)."""
    memory: float
    compute: float
    kv_read: float
    attention: float
    step_overhead_s: float
    request_overhead_s: float
    median_abs_rel_error: float
    max_abs_rel_error: float
    samples: int


def nnls(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares by trying every subset of columns (few columns)."""
    best_x, best_loss = np.zeros(a.shape[1]), float((y ** 2).sum())
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            sol = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
            if (sol < 0).any():
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = sol
            loss = float(((a @ x - y) ** 2).sum())
            if loss < best_loss:
                best_x, best_loss = x, loss
    return best_x, best_loss


def fit(weights_s, matmul_s, kv_s, attention_s, requests, seconds) -> Fit:
    """Fit the factors to samples (equal-length sequences; seconds > 0).

    Raises:
        ValueError: fewer than 5 samples, or a non-positive time.
    """
    w, mm, kv, at, n, t = (np.asarray(v, dtype=np.float64) for v in
                           (weights_s, matmul_s, kv_s, attention_s, requests, seconds))
    if len(t) < 5 or not (t > 0).all():
        raise ValueError(f"a fit needs at least 5 steps with positive times, got {len(t)}")
    inv = 1.0 / t
    linear = np.stack([kv * inv, at * inv, inv, n * inv], axis=1)

    def search(mems, comps):
        best = None
        for em in mems:
            for ec in comps:
                x, loss = nnls(linear, (t - np.maximum(w / em, mm / ec)) * inv)
                if best is None or loss < best[0]:
                    best = (loss, float(em), float(ec), x)
        return best

    _, em, ec, _ = search(GRID, GRID)
    step = GRID[1] / GRID[0]
    _, em, ec, x = search(np.geomspace(em / step, min(MAX_EFFICIENCY, em * step), 13),
                          np.geomspace(ec / step, min(MAX_EFFICIENCY, ec * step), 13))
    kv_read, attention = (MAX_EFFICIENCY if c * MAX_EFFICIENCY < 1 else float(1.0 / c) for c in x[:2])
    pred = np.maximum(w / em, mm / ec) + kv / kv_read + at / attention + x[2] + x[3] * n
    err = np.abs(pred - t) / t
    return Fit(em, ec, kv_read, attention, float(x[2]), float(x[3]), float(np.median(err)), float(err.max()), len(t))
