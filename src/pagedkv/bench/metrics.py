"""Benchmark metrics: latency percentiles, throughput, KV memory waste.

Definitions (seconds; ``token_times`` are absolute ``time.perf_counter`` stamps):

- TTFT  = first token time - arrival time
- TPOT  = (last token time - first token time) / (output tokens - 1), per request
- ITL   = each gap between consecutive tokens of a request (all gaps pooled)
- e2e   = last token time - arrival time
- KV memory waste of one sample = 1 - filled slots / allocated slots, where allocated
  slots are ``block_size`` x blocks held by requests (shared blocks once) and filled
  slots hold a token whose KV is written (``KVCacheManager.slot_usage``). The run's
  waste is slot-weighted over samples: sum(allocated - filled) / sum(allocated).

Percentiles interpolate linearly between order statistics (numpy's default ``linear``
method), so p50 of ``[1, 2, 3, 4]`` is 2.5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(values, p: float) -> float | None:
    """The ``p``-th percentile (0 <= p <= 100) of ``values`` by linear interpolation;
    ``None`` for no values.

    Raises:
        ValueError: for ``p`` outside [0, 100].
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    s = sorted(values)
    if not s:
        return None
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def distribution(values) -> dict:
    """``{"mean", "p50", "p90", "p99", "n"}`` of ``values`` (``None``s when empty)."""
    vals = list(values)
    out = {"mean": sum(vals) / len(vals) if vals else None}
    out |= {f"p{p}": percentile(vals, p) for p in PERCENTILES}
    return out | {"n": len(vals)}


@dataclass
class RequestRecord:
    """What one request did; times are absolute seconds (``time.perf_counter``)."""
    arrival: float
    num_prompt_tokens: int
    token_times: list[float]
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    index: int = -1                    # position in the workload
    output_token_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class WasteSamples:
    """``(allocated, filled)`` token slots, one pair per engine step."""
    allocated: list[int] = field(default_factory=list)
    filled: list[int] = field(default_factory=list)

    def add(self, allocated: int, filled: int) -> None:
        if not 0 <= filled <= allocated:
            raise ValueError(f"filled slots {filled} outside [0, allocated={allocated}]")
        self.allocated.append(allocated)
        self.filled.append(filled)

    def per_sample(self) -> list[float]:
        """Waste of each sample that holds any slot."""
        return [1 - f / a for a, f in zip(self.allocated, self.filled) if a]

    def summary(self) -> dict:
        """Slot-weighted ``waste`` over the run, plus the per-step mean, p50 and max."""
        total = sum(self.allocated)
        per = self.per_sample()
        return {"waste": (total - sum(self.filled)) / total if total else None,
                "waste_step_mean": sum(per) / len(per) if per else None,
                "waste_step_p50": percentile(per, 50), "waste_step_max": max(per, default=None),
                "samples": len(self.allocated)}


def summarize_requests(records: list[RequestRecord], duration_s: float) -> dict:
    """Throughput and latency figures of a run lasting ``duration_s`` seconds."""
    out_tok = sum(r.num_output_tokens for r in records)
    prompt_tok = sum(r.num_prompt_tokens for r in records)
    done = [r for r in records if r.token_times]
    return {
        "num_requests": len(records), "duration_s": duration_s,
        "prompt_tokens": prompt_tok, "output_tokens": out_tok,
        "cached_prompt_tokens": sum(r.num_cached_tokens for r in records),
        "requests_per_s": len(done) / duration_s if duration_s > 0 else None,
        "output_tokens_per_s": out_tok / duration_s if duration_s > 0 else None,
        "total_tokens_per_s": (out_tok + prompt_tok) / duration_s if duration_s > 0 else None,
        "ttft_s": distribution(r.ttft for r in done),
        "tpot_s": distribution(r.tpot for r in done if r.tpot is not None),
        "itl_s": distribution(x for r in done for x in r.itls),
        "e2e_s": distribution(r.e2e for r in done),
        "preemptions": sum(r.num_preemptions for r in records),
    }


def median(values) -> float | None:
    return percentile([v for v in values if v is not None], 50)
