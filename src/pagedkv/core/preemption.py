"""Preemption modes (``--preemption-mode``, vLLM's name): what happens to the KV of a request
the scheduler preempts when pages run out.

- ``recompute`` (default): its pages are freed and its tokens computed again on resume
  (less what a prefix cache or KV tier still holds).
- ``swap``: its pages are copied to the CPU KV tier (``--kv-offload-memory``) and back on
  resume (:mod:`pagedkv.connectors.offload.swap`); recompute when the tier has no room.
- ``auto``: per victim, whichever is predicted cheaper::

      swap_s      = 2 * copy bytes / measured copy rate          (out now, in on resume)
      recompute_s = FLOPs(reused .. kept tokens) / measured FLOP rate

  FLOPs as the planner's roofline counts them (:mod:`pagedkv.planner.roofline`):
  ``2 * layer matmul params`` per token plus ``2 * layers * heads * (d_qk + d_v)`` per
  causal query-key pair; the tokens the tier already holds (``reused``) cost the same
  either way and are left out. The FLOP rate is measured on this engine's own steps of at
  least :data:`MIN_RATE_TOKENS` tokens (prefill-like: decode steps measure memory, not
  compute); until one has run, ``auto`` swaps.

Swap never aborts a request: without room it falls back to recompute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedkv.config.engine import PREEMPTION_MODES
from pagedkv.planner.roofline import causal_pairs

MIN_RATE_TOKENS = 32
KEPT_DECISIONS = 1024


@dataclass(frozen=True)
class Decision:
    """One victim's choice: ``mode`` and the predicted seconds of each way (None: unknown)."""
    request_id: str
    kept_tokens: int
    mode: str
    swap_s: float | None
    recompute_s: float | None


class PreemptionCost:
    """Prices swap against recompute for one model.

    Args:
        mode: one of :data:`PREEMPTION_MODES`.
        layer_matmul_params: q, k, v, o, gate, up and down parameters over all layers.
        attn_flops_per_pair: ``2 * layers * heads * (d_qk + d_v)``.

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mode: str, layer_matmul_params: int, attn_flops_per_pair: int) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.mode, self.mm, self.attn = mode, layer_matmul_params, attn_flops_per_pair
        self.flops = self.seconds = 0.0
        self.decisions: deque[Decision] = deque(maxlen=KEPT_DECISIONS)

    def recompute_flops(self, start: int, end: int) -> float:
        """FLOPs of computing tokens ``start .. end - 1`` of a sequence (all layers, no LM head)."""
        n = max(0, end - start)
        return 2.0 * self.mm * n + self.attn * causal_pairs(start, n)

    def observe(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        """A step computed ``(start, num_tokens)`` chunks in ``seconds``."""
        if seconds > 0 and sum(n for _, n in chunks) >= MIN_RATE_TOKENS:
            self.flops += sum(self.recompute_flops(s, s + n) for s, n in chunks)
            self.seconds += seconds

    @property
    def flop_rate(self) -> float | None:
        """Measured FLOP/s of this engine's prefill-like steps, or None before one ran."""
        return self.flops / self.seconds if self.seconds > 0 else None

    def choose(self, request_id: str, plan) -> str:
        """``swap`` or ``recompute`` for a victim, given its :class:`~pagedkv.connectors.base.SwapPlan`
        (None: the connector cannot keep it)."""
        if plan is None or self.mode == "recompute":
            return "recompute"
        rate = self.flop_rate
        recompute_s = self.recompute_flops(plan.reused_tokens, plan.kept_tokens) / rate if rate else None
        swap_s = plan.copy_seconds if plan.copy_seconds > 0 or plan.copy_bytes == 0 else None
        mode = "swap"
        if self.mode == "auto" and recompute_s is not None and swap_s is not None and recompute_s < swap_s:
            mode = "recompute"
        self.decisions.append(Decision(request_id, plan.kept_tokens, mode, swap_s, recompute_s))
        return mode


