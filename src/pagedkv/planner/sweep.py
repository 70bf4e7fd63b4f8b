"""``--sweep``: one plan per model × GPU, as a table.

Each cell uses ``--tp`` or, where the weights do not fit at that degree, the
smallest degree at which they do (so every row says something useful); cells
where no degree up to 64 fits say so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.planner.hardware import gpu_names
from pagedkv.planner.models import bundled_names
from pagedkv.planner.plan import plan

GIB = 2**30


@dataclass(frozen=True)
class SweepCell:
    """One model on one GPU type. Sizes in bytes; ``decode_tokens_per_s`` is the bound at ``batch``."""
    model: str
    gpu: str
    tp: int
    bytes_per_token: int
    weight_bytes_per_device: int
    cache_budget_bytes: int
    max_concurrent_requests: int
    decode_tokens_per_s: float | None
    limited_by: str | None
    weights_fit: bool
    batch_fits: bool


def sweep_cell(model: str, gpu: str, tp: int, **kw) -> SweepCell:
    """Plan ``model`` on ``gpu``, raising ``tp`` to the smallest degree that holds the weights."""
    r = plan(model=model, gpu=gpu, tp=tp, **kw)
    if not r.weights_fit and r.min_tp_for_weights and r.min_tp_for_weights > tp:
        r = plan(model=model, gpu=gpu, tp=r.min_tp_for_weights, **kw)
    fit = bool(r.weights_fit)
    return SweepCell(r.model, r.gpu, r.tp, r.bytes_per_token, r.weight_bytes_per_device,
                     max(r.cache_budget_bytes, 0), r.max_concurrent_requests,
                     r.decode.tokens_per_s if fit else None, r.decode.limited_by if fit else None, fit,
                     bool(r.batch_fits))


def run_sweep(models: list[str] | None = None, gpus: list[str] | None = None, tp: int = 1, **kw) -> list[SweepCell]:
    """Every model × GPU (default: all bundled models × all catalog GPUs); ``kw`` goes to :func:`plan`."""
    return [sweep_cell(m, g, tp, **kw) for m in (models or bundled_names()) for g in (gpus or gpu_names())]


def render_sweep(cells: list[SweepCell], seq_len: int, batch: int) -> str:
    """A fixed-width table; sizes in GiB (2^30 bytes); ``*`` marks a batch that does not fit."""
    head = (f"{'model':<22} {'gpu':<15} {'tp':>3} {'B/token':>10} {'weights/dev':>12} {'cache/dev':>10} "
            f"{'reqs@' + format(seq_len, ','):>11} {'tok/s@' + str(batch):>12}  bound")
    lines = [head, "-" * len(head)]
    for c in cells:
        tok = f"{c.decode_tokens_per_s:,.0f}" if c.decode_tokens_per_s is not None else "-"
        tok += " " if c.batch_fits else "*"
        lines.append(f"{c.model:<22} {c.gpu:<15} {c.tp:>3} {c.bytes_per_token:>10,} "
                     f"{c.weight_bytes_per_device / GIB:>8.1f} GiB {c.cache_budget_bytes / GIB:>6.1f} GiB "
                     f"{c.max_concurrent_requests:>11,} {tok:>11}  "
                     f"{c.limited_by or 'weights do not fit at tp<=64'}")
    lines.append(f"GiB = 2^30 bytes, per device. tok/s: decode lower-bound rate at batch {batch}; "
                 f"* = that batch does not fit in the cache.")
    return "\n".join(lines)


def sweep_dicts(cells: list[SweepCell]) -> list[dict]:
    """JSON-ready rows."""
    return [asdict(c) for c in cells]
