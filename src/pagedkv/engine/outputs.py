"""RequestOutput and the text side of a request: detokenization and stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.request import Request


@dataclass
class RequestOutput:
    """What a request has produced so far (cumulative), or in full once ``finished``.

    Timings are seconds: ``ttft`` arrival -> first token; ``tpot`` mean time per output
    token after the first; ``e2e`` arrival -> last token. ``num_cached_tokens`` is the
    prompt prefix served from the prefix cache. ``error`` says why a request that ended
    with ``finish_reason == "abort"`` failed (e.g. non-finite logits), else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None  # per prompt position; None at 0
    prompt_top_logprobs: list[dict[int, float] | None] | None = None  # top-k per position (prompt_logprobs=k>0)
    token_times: list[float] = field(default_factory=list, repr=False)


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Earliest ``(index, stop_string)`` of any stop string in ``text``."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def hold_back(text: str, stops: list[str]) -> str:
    """Drop a trailing partial match of a stop string, so streamed text never shows
    the start of a stop string that later completes."""
    cut = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                cut = max(cut, k)
                break
    return text[:len(text) - cut] if cut else text


def make_output(req: Request, text: str) -> RequestOutput:
    ttft = tpot = e2e = None
    if req.first_token_time is not None:
        ttft = req.first_token_time - req.arrival_time
        e2e = req.last_token_time - req.arrival_time
        n = len(req.output_token_ids)
        tpot = (req.last_token_time - req.first_token_time) / (n - 1) if n > 1 else 0.0
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
        text=text, token_ids=list(req.output_token_ids), finished=req.is_finished,
        finish_reason=req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0), num_preemptions=req.num_preemptions,
        stop_reason=req.stop_reason, error=req.error, ttft=ttft, tpot=tpot, e2e=e2e,
        logprobs=list(req.logprobs) if req.sampling_params.logprobs is not None else None,
        prompt_logprobs=([req.prompt_logprobs.get(i) for i in range(req.num_prompt_tokens)]
                         if req.sampling_params.prompt_logprobs is not None else None),
        prompt_top_logprobs=([req.prompt_top_logprobs.get(i) for i in range(req.num_prompt_tokens)]
                             if req.sampling_params.prompt_logprobs else None),
        token_times=list(req.token_times))
