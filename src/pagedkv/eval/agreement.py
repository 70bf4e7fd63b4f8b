"""Greedy agreement of a KV setting with the float32 cache, through the engine.

The float32 engine generates a greedy continuation G (``max_tokens``, ignore_eos) of each
prompt P. For every setting:

- **teacher-forced agreement**: P + G is sent with ``prompt_logprobs=1``; at each position
  of G the setting's argmax (top-1) is compared with G's token. Every position is judged on
  the same float32 prefix, so one early flip does not decide the rest.
- **free-running agreement**: the setting generates greedily from P itself; the tokens it
  shares with G before the first difference, over all of G's tokens (a strict measure: after
  a near-tie flips, the texts part ways even when both are fine).

The float32 setting's own teacher-forced agreement is the engine's noise floor (the batch
and chunk shape of P + G differ from those of the generation; see :mod:`pagedkv.numerics`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from pagedkv.core.sampling_params import SamplingParams
from pagedkv.eval.settings import KVSetting


@dataclass(frozen=True)
class AgreementResult:
    setting: str
    teacher_forced: float     # fraction of G's tokens that are the setting's argmax
    free_running: float       # fraction of G's tokens matched before the first difference
    num_tokens: int
    num_prompts: int

    def to_dict(self) -> dict:
        return asdict(self)


def greedy_agreement(make_llm: Callable[[KVSetting], object], prompts: list[list[int]], max_tokens: int,
                     settings: list[KVSetting], baseline: KVSetting = KVSetting("float32")) -> list[AgreementResult]:
    """Agreement of each setting with ``baseline``'s greedy continuations of ``prompts``
    (token-id lists). ``make_llm(setting)`` builds a :class:`pagedkv.LLM` for a setting.

    Raises:
        ValueError: no prompt, or ``max_tokens`` < 1.
    """
    if not prompts or max_tokens < 1:
        raise ValueError("greedy agreement needs at least one prompt and max_tokens >= 1")
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = make_llm(baseline)
    conts = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    del llm
    total = sum(len(c) for c in conts)
    results = []
    for s in settings:
        llm = make_llm(s)
        forced = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, conts)],
                              SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        hits = sum(next(iter(o.prompt_top_logprobs[len(p) + j])) == tok
                   for o, p, c in zip(forced, prompts, conts) for j, tok in enumerate(c))
        free = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        shared = sum(common_prefix(o.token_ids, c) for o, c in zip(free, conts))
        results.append(AgreementResult(s.label, hits / total, shared / total, total, len(prompts)))
        del llm
    return results


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
