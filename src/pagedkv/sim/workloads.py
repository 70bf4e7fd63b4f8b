"""Simulator workloads: the benchmark's real ones, synthetic length distributions, traces.

- ``arena-hard``, ``hh-rlhf``, ``shared-prefix``: :mod:`pagedkv.bench.workloads`, tokenized
  with the default model's tokenizer (a simulated model's own tokenizer is not loaded:
  its lengths differ by the tokenizers' ratio, a few percent between BPE vocabularies).
- ``random``: prompt and output lengths drawn uniformly from ``[len * (1 - range_ratio),
  len * (1 + range_ratio)]`` (vLLM's ``--random-input-len/--random-output-len/--random-range-ratio``).
- ``sharegpt-like`` and ``alpaca-like``: lognormal lengths with the means the PagedAttention
  paper reports for its traces (Kwon et al., SOSP 2023, section 6.1: ShareGPT 161.31
  input / 337.99 output tokens, Alpaca 19.31 / 58.45). The paper gives histograms, not
  parameters: the lognormal shape and its ``sigma`` (:data:`LENGTH_SIGMA`) are our
  assumption; lengths are clipped to ``[1, max]``.
- a trace: a JSONL file, one ``{"arrival": s, "prompt_len": n, "output_len": m}`` per line.

Synthetic prompts are random token ids (no two share a prefix). Arrivals are Poisson at a
rate (:func:`pagedkv.bench.workloads.with_poisson_arrivals`) or, for a trace, its own.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from pagedkv.bench.workloads import DATASETS, BenchRequest
from pagedkv.reprs import brief

SYNTHETIC = ("random", "sharegpt-like", "alpaca-like")
#: (mean input, mean output) tokens, Kwon et al. 2023 section 6.1
PAPER_MEANS = {"sharegpt-like": (161.31, 337.99), "alpaca-like": (19.31, 58.45)}
LENGTH_SIGMA = 0.9  # lognormal shape of the paper-like lengths: our assumption (see above)
VOCAB = 32000       # token ids of synthetic prompts are drawn below this
#: Latest arrival the virtual clock takes (seconds, ~32 years): float64 seconds resolve ~0.1 us
#: there, while at a rate of 1e-15 req/s (arrivals near 1e15 s) a millisecond TTFT rounds to 0.
MAX_ARRIVAL_S = 1e9


def random_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, VOCAB) for _ in range(n))


def lognormal_len(rng: random.Random, mean: float, cap: int) -> int:
    """A lognormal length of the given mean (sigma :data:`LENGTH_SIGMA`), in ``[1, cap]``."""
    mu = math.log(mean) - LENGTH_SIGMA ** 2 / 2
    return max(1, min(cap, round(rng.lognormvariate(mu, LENGTH_SIGMA))))


def synthetic_workload(name: str, num_prompts: int, input_len: int = 256, output_len: int = 128,
                       range_ratio: float = 0.0, max_model_len: int = 2048, seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` requests of a synthetic length distribution (see the module docstring);
    prompt + output never exceed ``max_model_len``.

    Raises:
        ValueError: an unknown name or a bad length.
    """
    if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic workload {name!r}; choose from {', '.join(SYNTHETIC)}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if any(isinstance(n, bool) or not isinstance(n, int) for n in (num_prompts, input_len, output_len, max_model_len)):
        raise ValueError(f"prompt count and lengths must be integers, got num_prompts {brief(num_prompts)}, input_len "
                         f"{brief(input_len)}, output_len {brief(output_len)}, max_model_len {brief(max_model_len)}")
    if name == "random" and (input_len < 1 or output_len < 1 or input_len + output_len > max_model_len):
        raise ValueError(f"input {input_len} + output {output_len} tokens must be positive and fit "
                         f"max_model_len {max_model_len}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len {max_model_len} holds no prompt and output token")
    rng, out = random.Random(seed), []
    for i in range(num_prompts):
        if name == "random":
            p = rng.randint(max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio)))
            o = rng.randint(max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio)))
        else:
            mi, mo = PAPER_MEANS[name]
            p = lognormal_len(rng, mi, max_model_len - 1)
            o = lognormal_len(rng, mo, max_model_len - p)
        p = min(p, max_model_len - 1)
        o = min(o, max_model_len - p)
        out.append(BenchRequest(random_ids(rng, p), o, o, label=f"{name}/{i}"))
    return out


def load_trace(path: str | Path, seed: int = 0, max_model_len: int | None = None) -> list[BenchRequest]:
    """Requests of a JSONL trace (``arrival`` seconds, ``prompt_len``, ``output_len`` per line).
    Arrivals count from the earliest one (absolute timestamps work); a request longer than
    ``max_model_len`` tokens is refused, naming its line, before its ids are made.

    Raises:
        ValueError: an unreadable or empty file, or a line without those fields, with a
            bad value or too long (named by number).
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read trace {path}: {e}") from None
    rows = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            t, p, o = row["arrival"], row["prompt_len"], row["output_len"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise ValueError(f"trace {path} line {no}: expected {{\"arrival\", \"prompt_len\", \"output_len\"}} "
                             f"({type(e).__name__})") from None
        if not all(_whole(n) for n in (p, o)) or isinstance(t, bool) or not isinstance(t, (int, float)):
            raise ValueError(f"trace {path} line {no}: prompt_len and output_len must be integers and arrival a "
                             f"number, got {brief(p)}, {brief(o)}, {brief(t)}")
        p, o, t = int(p), int(o), _seconds(t)
        if p < 1 or o < 1 or not t >= 0 or t == float("inf"):
            raise ValueError(f"trace {path} line {no}: lengths must be >= 1 and arrival a finite time >= 0")
        if max_model_len is not None and p + o > max_model_len:
            raise ValueError(f"trace {path} line {no}: {p} + {o} tokens exceed max_model_len {max_model_len}")
        rows.append((no, t, p, o))
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    rng, t0 = random.Random(seed), min(t for _, t, _, _ in rows)
    for no, t, _, _ in rows:
        if t - t0 > MAX_ARRIVAL_S:
            raise ValueError(f"trace {path} line {no}: arrives {t - t0:,.6g} s after the first request, past the "
                             f"simulator's limit of {MAX_ARRIVAL_S:,.0f} s (its clock would lose sub-millisecond time)")
    return [BenchRequest(random_ids(rng, p), o, o, t - t0, label=f"trace/{no}") for no, t, p, o in rows]


def _seconds(t: int | float) -> float:
    """An arrival as float seconds; an integer past float's range is infinitely late."""
    try:
        return float(t)
    except OverflowError:
        return math.inf


def _whole(n) -> bool:
    """A JSON integer, or a float holding one (10.0, as some exporters write counts)."""
    return not isinstance(n, bool) and (isinstance(n, int) or (isinstance(n, float) and n.is_integer()))


def check_requests(reqs: list[BenchRequest]) -> None:
    """Refuse a request list the driver cannot run as meant.

    Raises:
        ValueError: an empty prompt, ``output_len`` under 1 or over ``max_tokens``, or an
            arrival that is not a finite time >= 0 (naming the request's index).
    """
    for i, r in enumerate(reqs):
        if not isinstance(r, BenchRequest):
            raise ValueError(f"request {i}: a workload list holds BenchRequest objects, got {brief(r)}")
        if not r.prompt_token_ids or r.output_len < 1 or r.max_tokens < r.output_len:
            raise ValueError(f"request {i}: needs a prompt and 1 <= output_len <= max_tokens "
                             f"(got {r.num_prompt_tokens} prompt tokens, output_len {r.output_len}, "
                             f"max_tokens {r.max_tokens})")
        if not 0 <= r.arrival_s <= MAX_ARRIVAL_S:
            raise ValueError(f"request {i}: arrival_s must be a time from 0 to {MAX_ARRIVAL_S:.0e} s (the "
                             f"simulator's clock resolves microseconds up to there), got {r.arrival_s}")


def dataset_workload(name: str, num_prompts: int, max_prompt_tokens: int, max_tokens: int,
                     seed: int = 0) -> list[BenchRequest]:
    """A benchmark dataset (:data:`pagedkv.bench.workloads.DATASETS`), tokenized with the
    default model's tokenizer."""
    from pagedkv.bench.workloads import build_workload
    from pagedkv.config.engine import DEFAULT_MODEL
    from pagedkv.model.loader import load_tokenizer, resolve_model

    if name not in DATASETS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(DATASETS + SYNTHETIC)} or --trace")
    tok = load_tokenizer(resolve_model(DEFAULT_MODEL).folder)
    reqs = build_workload(name, tok, num_prompts, max_prompt_tokens, max_tokens, seed)
    if len(reqs) < num_prompts:
        raise ValueError(f"the {name} workload has {len(reqs)} prompts; {num_prompts} asked for")
    return reqs
