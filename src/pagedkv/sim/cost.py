"""The simulator's step clock: the planner's roofline with efficiency factors and overheads.

One cost model, shared with the planner (:mod:`pagedkv.planner.roofline`). A step's
:class:`~pagedkv.planner.roofline.StepWork` (tokens, sampled rows, KV tokens read,
query-key pairs) is priced on a device (memory bandwidth, matrix rate) as::

    memory_s  = (weight bytes + KV bytes read) / bandwidth
    compute_s = FLOPs / matmul rate
    seconds   = max(memory_s / memory_efficiency, compute_s / compute_efficiency)
                + step_overhead_s + request_overhead_s * requests in the step

With every efficiency 1 and no overheads this is the roofline lower bound itself.
:mod:`pagedkv.sim.calibrate` fits the four factors for this CPU from a profile of the
real engine; catalog GPUs use the plain roofline unless given factors (the efficiency
a datasheet's peak reaches in practice is workload-dependent: say which you assume).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.planner.roofline import Ceilings, ModelCost, StepWork, step_terms


@dataclass(frozen=True)
class Efficiency:
    """How far a real step falls short of the roofline.

    Attributes:
        memory: fraction of the peak bandwidth a memory-bound step reaches (0, 1].
        compute: fraction of the peak matrix rate a compute-bound step reaches (0, 1].
        step_overhead_s: seconds every step adds (scheduling, launches, sampling), >= 0.
        request_overhead_s: seconds each request in the step adds (per-sequence
            metadata, Python), >= 0.
        source: where the numbers come from (``roofline``, or the calibration run).

    Raises:
        ValueError: an efficiency outside (0, 1.5] or a negative overhead.
    """
    memory: float = 1.0
    compute: float = 1.0
    step_overhead_s: float = 0.0
    request_overhead_s: float = 0.0
    source: str = "roofline (no efficiency factors, no overheads)"

    def __post_init__(self) -> None:
        for name in ("memory", "compute"):  # (a measured ceiling can be beaten a little)
            if not 0.0 < getattr(self, name) <= 1.5:
                raise ValueError(f"{name} efficiency must be in (0, 1.5], got {getattr(self, name)!r}")
        for name in ("step_overhead_s", "request_overhead_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepCost:
    """Prices steps of one model on one device (per device of a tensor-parallel group:
    ``cost`` is already one device's share).

    Args:
        cost: bytes and FLOPs per unit of work (:func:`pagedkv.planner.roofline.config_cost`).
        device: anything with ``bandwidth`` (bytes/s) and ``matmul_rate(dtype)`` (FLOP/s).
        compute_dtype: the dtype name passed to ``matmul_rate``.
        efficiency: factors and overheads (default: the plain roofline).
    """
    cost: ModelCost
    device: Ceilings
    compute_dtype: str = "float32"
    efficiency: Efficiency = Efficiency()

    def terms(self, work: StepWork) -> tuple[float, float]:
        """``(memory_s, compute_s)`` of the roofline, before efficiency factors."""
        t = step_terms(work, self.cost, self.device, self.compute_dtype)
        return t["weight-read"] + t["kv-read"], t["compute"]

    def seconds(self, work: StepWork, num_requests: int) -> float:
        """Modelled seconds of one step computing ``work`` for ``num_requests`` requests."""
        e = self.efficiency
        mem, comp = self.terms(work)
        return max(mem / e.memory, comp / e.compute) + e.step_overhead_s + e.request_overhead_s * num_requests
