"""Lossless verification of one request's draft tokens against the target's logits.

The target computed logits at the request's last committed token and at each of its ``d``
drafts: rows ``0 .. d`` of ``[d + 1, V]``; row ``i`` predicts the token after draft ``i``
(row 0: after the last committed token). Verification returns the tokens to commit: the
accepted drafts, then one more (the correction at the first rejection, or the bonus token
after a full acceptance), so 1 .. d + 1 tokens.

- Greedy requests accept draft ``i`` while it equals the argmax of row ``i`` (lowest id on
  ties, as :func:`pagedkv.worker.sampler.sample` picks): the output is exactly what
  non-speculative greedy decoding produces.
- Sampled requests: rejection sampling (Leviathan et al. 2023, arXiv:2211.17192, Alg. 1;
  Chen et al. 2023, arXiv:2302.01318) with a one-hot proposal (n-gram drafts put all mass
  on the draft ``x``): accept ``x`` with probability ``p(x)``, ``p`` the request's own
  distribution (temperature, top-k, top-p: :func:`pagedkv.worker.sampler.target_probs`);
  on rejection sample from ``p`` with ``x`` removed, renormalized. Each committed token is
  then distributed exactly as ``p`` (the theorem of both papers), drawn from the request's
  own generator.
- A draft model that sampled its drafts from its own distribution ``q`` (the same
  temperature, top-k, top-p applied to the draft's logits): accept ``x`` with probability
  ``min(1, p(x) / q(x))``, on rejection sample from ``max(0, p - q)`` renormalized (the
  general form of the same algorithm; the one-hot case above is ``q = 1`` at ``x``).

Log-probs, where asked, are the target's (row of each committed token).
"""

from __future__ import annotations

import torch

from pagedkv.core.sampling_params import SamplingParams
from pagedkv.worker.sampler import SampledToken, first_argmax, target_probs, token_logprobs


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None, draft_probs: torch.Tensor | None = None) -> list[SampledToken]:
    """The tokens to commit for one request (see the module doc); ``logits`` ``[d + 1, V]``
    fp32; ``draft_probs`` ``[>= d, V]``: the draft model's distribution each draft was
    sampled from (None: one-hot proposals). Raises ValueError for non-finite logits in a
    row it reads."""
    tokens = (_greedy(logits, drafts) if params.greedy
              else _rejection(logits, drafts, params, generator, draft_probs))
    return [SampledToken(t, token_logprobs(logits[i], t, params.logprobs) if params.logprobs is not None else None)
            for i, t in enumerate(tokens)]


def _greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    best = first_argmax(logits)
    finite = torch.isfinite(logits.gather(1, best.unsqueeze(1))).squeeze(1).tolist()
    best = best.tolist()
    out = []
    for i in range(len(drafts) + 1):  # rows after the first rejection are never read
        if not finite[i]:
            raise ValueError("the model produced non-finite logits")
        if i == len(drafts) or drafts[i] != best[i]:
            return out + [best[i]]
        out.append(drafts[i])
    raise AssertionError("unreachable")


def _rejection(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
               generator: torch.Generator | None, draft_probs: torch.Tensor | None) -> list[int]:
    out = []
    for i, x in enumerate(drafts):
        p = target_probs(logits[i], params)
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(p[x]):  # u < p(x) / q(x)
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0  # p(x) < 1 here, so some mass is left
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)  # p(x) < q(x) here: mass is left elsewhere
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: sampling p is exact
                residual = p
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
    p = target_probs(logits[len(drafts)], params)
    return out + [int(torch.multinomial(p, 1, generator=generator))]
