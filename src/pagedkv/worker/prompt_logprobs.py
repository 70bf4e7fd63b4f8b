"""Prompt log-probs of a step's prefill chunks (vLLM's ``prompt_logprobs``).

For a chunk computing positions ``[start, start + n)`` of a request, row ``start + i``'s
logits predict token ``start + i + 1``; the positions that still have a next prompt
token get ``log p(prompt[pos] | prompt[:pos])`` (natural log), and the top-k of each
when ``prompt_logprobs = k > 0``.
"""

from __future__ import annotations

from typing import Iterable

import torch

from pagedkv.core.runner_io import PromptLogprobs


def prompt_logprobs(model, hidden: torch.Tensor, chunks: Iterable) -> dict[str, PromptLogprobs]:
    """Per request asking for them, the prompt log-probs its chunk yields.

    ``hidden`` ``[T, hidden]``: the step's final hidden states; ``chunks``: ``(state,
    first row, num rows)`` per request, where ``state`` has ``req_id``, ``token_ids``,
    ``num_prompt_tokens``, ``num_computed_tokens`` (the chunk's start) and ``sampling_params``.
    """
    out = {}
    for st, row, n in chunks:
        k = st.sampling_params.prompt_logprobs
        start = st.num_computed_tokens
        last = min(start + n, st.num_prompt_tokens - 1)  # positions with a next prompt token
        if k is None or start >= last:
            continue
        logp = torch.log_softmax(model.logits(hidden[row:row + last - start]), dim=-1)
        targets = torch.tensor(st.token_ids[start + 1:last + 1], device=logp.device)
        values = logp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        top = None
        if k:
            t = torch.topk(logp, k, dim=-1)
            top = [dict(zip(i, v)) for i, v in zip(t.indices.tolist(), t.values.tolist())]
        out[st.req_id] = PromptLogprobs(start + 1, values, top)
    return out
