"""The simulator's step clock: the planner's roofline with efficiency factors and overheads.

One cost model, shared with the planner (:mod:`pagedkv.planner.roofline`). A step's
:class:`~pagedkv.planner.roofline.StepWork` (tokens, sampled rows, KV tokens read,
query-key pairs) is priced on a device (memory bandwidth, matrix rate) in four roofline
terms: weight bytes / bandwidth, matmul FLOPs / rate (the layers' projections and the LM
head), KV bytes / bandwidth and attention FLOPs / rate. With the plain roofline
(``Efficiency()``, the default for catalog GPUs) a step costs::

    seconds = max(weights_s + kv_s, matmul_s + attention_s)

which is the planner's bound exactly. A calibrated CPU (:mod:`pagedkv.sim.calibrate`)
runs the projections and the attention as separate phases (the attention over pages is
its own kernel, after a layer's projections, and reads KV at a rate of its own), each
term at its own fraction of the roofline, plus fixed costs::

    seconds = (max(weights_s / memory, matmul_s / compute) + attention_s / attention
               + step_overhead_s + request_overhead_s * requests in the step) * few_row[M]
              + kv_s / kv_read * few_row_kv[M]

where ``few_row[M]`` and ``few_row_kv[M]`` correct decode steps of ``M`` requests (a few;
batched decodes of up to 64 where the profile has them), measured per ``M`` (1 for larger
steps, :func:`pagedkv.sim.calibrate.few_row_factors`); one request's prefill chunk alone (an
arrival at an idle engine) takes ``prefill[M]`` for both instead, interpolated in ``log M``
between the token counts of the profile's lone prefills
(:func:`pagedkv.sim.calibrate.prefill_factors`; 1 where none were measured), and a step
mixing prefill chunks with other requests none: a 48-row decode's factor priced a 50-token
prefill ~14% fast, and the batch-fitted terms priced lone 96-256-token prefills ~10% slow,
while steps of several requests' prefills fitted better uncorrected than with either
(AMD EPYC family 26, 2026-12-05). On this CPU the GGML-block
linear kernel widens each weight once per tile of up to 4 activation rows, and once per
row for a lone row (a single-row step, or the row after whole tiles at 5 and 9 rows;
``kernels/cpu/csrc/ggml_linear.cpp``), so its cost per row is not flat; and a decode of one
or two sequences reads its KV far below the rate a batch reaches (a 1-row step measured
9 us per cached token against 3.8 us modelled from the batch-fitted ``kv_read``): neither
is a roofline term. The simulator's runner adds ``idle_wake_s`` to the first step after
the engine sat idle (:class:`pagedkv.sim.runner.SimRunner`): measured, not modelled.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

from pagedkv.planner.roofline import Ceilings, ModelCost, StepWork
from pagedkv.reprs import brief

MAX_FEW_ROW_FACTOR = 1e3  # a step at 1,000x its modelled cost is a typo, not a machine
MAX_OVERHEAD_S = 3600.0
MAX_ANCHOR_ROWS = 1 << 40  # token rows of a prefill anchor: far past any context


def _real(v) -> bool:
    """A real number (numpy's too), not a boolean."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass(frozen=True)
class Efficiency:
    """How far a real step falls short of the roofline.

    Attributes:
        memory: fraction of the peak bandwidth a memory-bound step reaches (0, 1.5].
        compute: fraction of the peak matrix rate a compute-bound step reaches (0, 1.5].
        kv_read: fraction of the bandwidth the attention's KV reads reach when attention
            runs as a phase of its own, (0, 1.5]; ``None`` (the plain roofline): it overlaps
            with the projections, as the planner assumes (then ``attention`` is None too).
        attention: fraction of the matrix rate the attention FLOPs reach in that phase.
        few_row_factors: the ``few_row[M]`` factors above for ``M = 1, 2, ...`` token rows
            (each > 0); ``()``: none (1 for every step).
        few_row_kv_factors: the ``few_row_kv[M]`` factors (each > 0); ``()``: the KV term
            takes ``few_row[M]`` too.
        prefill_factors: ``(M, prefill[M])`` anchors, ``M`` ascending token rows (each
            factor > 0); ``()``: none.
        step_overhead_s: seconds every step adds (scheduling, launches, sampling), >= 0.
        request_overhead_s: seconds each request in the step adds (per-sequence
            metadata, Python), >= 0.
        idle_wake_s: seconds the first step after an idle wait adds (the simulator's
            runner applies it; :func:`pagedkv.sim.calibrate.idle_wake_seconds`), >= 0.
        source: where the numbers come from (``roofline``, or the calibration run).

    Raises:
        ValueError: an efficiency outside (0, 1.5] (a measured ceiling can be beaten a
            little), a few-row factor outside (0, 1000], an overhead outside [0, 3600] s,
            anything that is not a real number there (booleans and strings included), or a
            source that is not a string.
    """
    memory: float = 1.0
    compute: float = 1.0
    kv_read: float | None = None
    attention: float | None = None
    few_row_factors: tuple[float, ...] = ()
    few_row_kv_factors: tuple[float, ...] = ()
    prefill_factors: tuple[tuple[int, float], ...] = ()
    step_overhead_s: float = 0.0
    request_overhead_s: float = 0.0
    idle_wake_s: float = 0.0
    source: str = "roofline (no efficiency factors, no overheads)"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise ValueError(f"source must be a string, got {self.source!r}")
        if (self.kv_read is None) != (self.attention is None):
            raise ValueError("kv_read and attention efficiencies are both set (a separate attention phase) "
                             "or both None")
        for name in ("memory", "compute", "kv_read", "attention"):
            v = getattr(self, name)
            if not (v is None and name in ("kv_read", "attention")) and not (_real(v) and 0.0 < v <= 1.5):
                raise ValueError(f"{name} efficiency must be in (0, 1.5], got {v!r}")
        for name in ("few_row_factors", "few_row_kv_factors"):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)) or not all(_real(f) and 0 < f <= MAX_FEW_ROW_FACTOR for f in v):
                raise ValueError(f"{name} must be a list of numbers in (0, {MAX_FEW_ROW_FACTOR:g}], got {v!r}")
            object.__setattr__(self, name, tuple(float(f) for f in v))
        object.__setattr__(self, "prefill_factors", _anchors(self.prefill_factors))
        for name in ("step_overhead_s", "request_overhead_s", "idle_wake_s"):
            v = getattr(self, name)
            if not (_real(v) and 0.0 <= v <= MAX_OVERHEAD_S):
                raise ValueError(f"{name} must be in [0, {MAX_OVERHEAD_S:g}] seconds, got {v!r}")
            object.__setattr__(self, name, float(v) + 0.0)  # (a numpy scalar, -0.0: a plain 0.0)

    def to_dict(self) -> dict:
        return asdict(self)

    def correction(self, tokens: int, num_requests: int, kind: str | None = None) -> tuple[float, float]:
        """The factors of a step's ``(rest, kv)`` parts by its ``kind`` (:func:`step_kind`;
        None: from the shape alone, a step of one row a request being a decode and of one
        request a prefill): ``few_row[M]`` for a decode (speculative verify rows included),
        ``prefill[M]`` for one request's prefill chunk alone, 1 for a mixed step."""
        kind = kind or ("decode" if tokens == num_requests else "prefill" if num_requests == 1 else "mixed")
        if kind == "prefill" and self.prefill_factors:
            f = _interpolate_log(self.prefill_factors, tokens)
            return f, f
        return self.few_row(tokens) if kind == "decode" else (1.0, 1.0)

    def few_row(self, tokens: int) -> tuple[float, float]:
        """``(few_row[M], few_row_kv[M])`` for a step of ``tokens`` rows (1 past the tables)."""
        few = self.few_row_factors[tokens - 1] if 0 < tokens <= len(self.few_row_factors) else 1.0
        if not self.few_row_kv_factors:
            return few, few
        return few, self.few_row_kv_factors[tokens - 1] if 0 < tokens <= len(self.few_row_kv_factors) else 1.0


def step_kind(num_rows: list[int], num_drafts: list[int]) -> str:
    """``decode``, ``prefill`` or ``mixed``: a step whose chunks have ``num_rows`` rows, each
    verifying ``num_drafts`` speculative tokens (a decode chunk: 1 + drafts rows)."""
    prefills = sum(n > 1 + d for n, d in zip(num_rows, num_drafts))
    return "decode" if not prefills else "prefill" if len(num_rows) == 1 else "mixed"


def _anchors(v) -> tuple[tuple[int, float], ...]:
    """``(M, factor)`` pairs: M in [1, MAX_ANCHOR_ROWS] and ascending, factors in (0, MAX_FEW_ROW_FACTOR]."""
    bad = ValueError(f"prefill_factors must be (token rows, factor) pairs, rows ascending in [1, "
                     f"{MAX_ANCHOR_ROWS}] and factors in (0, {MAX_FEW_ROW_FACTOR:g}], got {brief(v)}")
    if not isinstance(v, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in v):
        raise bad
    out = tuple((p[0], p[1]) for p in v)
    if not all(isinstance(m, int) and not isinstance(m, bool) and 0 < m <= MAX_ANCHOR_ROWS and _real(f)
               and 0 < f <= MAX_FEW_ROW_FACTOR
               for m, f in out) or any(a[0] >= b[0] for a, b in zip(out, out[1:])):
        raise bad
    return tuple((m, float(f)) for m, f in out)


def _interpolate_log(anchors: tuple[tuple[int, float], ...], m: int) -> float:
    """The factor at ``m`` rows: straight between the anchors around it in ``log m``, the
    nearest end's past them."""
    if m <= anchors[0][0]:
        return anchors[0][1]
    for (m0, f0), (m1, f1) in zip(anchors, anchors[1:]):
        if m <= m1:
            return f1 if m == m1 else f0 + (f1 - f0) * (math.log(m) - math.log(m0)) / (math.log(m1) - math.log(m0))
    return anchors[-1][1]


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

    def phases(self, work: StepWork) -> tuple[float, float, float, float]:
        """``(weights_s, matmul_s, kv_s, attention_s)``: the roofline terms of ``work``."""
        c, bw, rate = self.cost, self.device.bandwidth, self.device.matmul_rate(self.compute_dtype)
        weights = c.weights_read(work.tokens, work.sampled)
        matmul = 2 * c.layer_matmul_params * work.tokens + 2 * c.lm_head_params * work.sampled
        return (weights / bw, matmul / rate, work.kv_tokens * c.kv_bytes_per_token / bw,
                c.attn_flops_per_pair * work.attn_pairs / rate)

    def terms(self, work: StepWork) -> tuple[float, float]:
        """``(memory_s, compute_s)`` of the plain roofline."""
        w, mm, kv, attn = self.phases(work)
        return w + kv, mm + attn

    def seconds(self, work: StepWork, num_requests: int, kind: str | None = None) -> float:
        """Modelled seconds of one step computing ``work`` for ``num_requests`` requests
        (``kind``: :func:`step_kind`, or None to tell it from the shape)."""
        return self.seconds_of(self.phases(work), num_requests, work.tokens, kind)

    def seconds_of(self, phases: tuple[float, float, float, float], num_requests: int, tokens: int = 0,
                   kind: str | None = None) -> float:
        """Modelled seconds of a step of ``tokens`` rows with these :meth:`phases` (see the
        module docstring), plus its tensor-parallel all-reduces (:meth:`allreduce_seconds`)."""
        rest, kv = self.parts(phases, num_requests)
        few, few_kv = self.efficiency.correction(tokens, num_requests, kind)
        return few * rest + few_kv * kv + self.allreduce_seconds(tokens)

    def allreduce_seconds(self, tokens: int) -> float:
        """The step's all-reduce time, as the planner's roofline counts it
        (:func:`~pagedkv.planner.roofline.allreduce_elements_per_token`); 0 at tp 1 or on a
        device without link figures."""
        elements, d = self.cost.allreduce_elements_per_token, self.device
        if not elements or not hasattr(d, "tp_link"):
            return 0.0
        return tokens * elements * d.activation_bytes / d.tp_link

    def parts(self, phases: tuple[float, float, float, float], num_requests: int) -> tuple[float, float]:
        """``(rest_s, kv_s)``: the step's modelled seconds before the few-row factors, with
        the separate KV-read phase apart (0 on the plain roofline, where KV reads overlap
        the projections)."""
        e = self.efficiency
        w, mm, kv, attn = phases
        over = e.step_overhead_s + e.request_overhead_s * num_requests
        if e.attention is None:
            return max((w + kv) / e.memory, (mm + attn) / e.compute) + over, 0.0
        return max(w / e.memory, mm / e.compute) + attn / e.attention + over, kv / e.kv_read
