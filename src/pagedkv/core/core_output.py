"""What the engine core hands the text side: per request and step, the new token ids.

:class:`EngineCoreOutput` is plain data (ids, floats, strings): the text side turns it
into text and :class:`~pagedkv.engine.outputs.RequestOutput`. Stop rules that need only
ids (EOS, ``stop_token_ids``, ``max_tokens``, ``max_model_len``) are the core's
(:func:`check_stop`); stop strings are the text side's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.core.request import Request


@dataclass(slots=True)
class EngineCoreOutput:
    """A request's news from one step.

    ``new_token_ids``/``new_logprobs``: tokens appended this step (and their log-probs if
    asked); ``token_time``: the core clock's reading when they were appended (seconds).
    ``prompt_logprobs``/``prompt_top_logprobs`` (position -> value) come with the first
    output of a request that asked for them, complete. ``finish_reason`` is set once it
    ended: ``stop``, ``length`` or ``abort`` (then ``error`` may say why).
    """
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    prompt_logprobs: dict[int, float] | None = None
    prompt_top_logprobs: dict[int, dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, req: Request, new_ids: list[int], new_logprobs: list[dict[int, float]]) -> EngineCoreOutput:
        """Snapshot of ``req`` after ``new_ids`` were appended (prompt log-probs on its first output)."""
        wants = req.sampling_params.prompt_logprobs is not None and (
            len(req.output_token_ids) == len(new_ids) or req.is_finished)  # (first output, or the last)
        return cls(req.request_id, list(new_ids), list(new_logprobs), req.last_token_time,
                   req.finish_reason, req.stop_reason, req.error, max(req.num_cached_tokens, 0),
                   req.num_preemptions, dict(req.prompt_logprobs) if wants else None,
                   dict(req.prompt_top_logprobs) if wants else None)


def check_stop(req: Request, eos_token_ids: frozenset[int], max_model_len: int | None) -> tuple[str | None, int | None]:
    """``(finish_reason, stop_reason)`` after the request's last token, or ``(None, None)``.

    A ``stop_token_ids`` hit reports the token as ``stop_reason`` (the token stays in
    ``token_ids``; the text side leaves its text out); EOS stops unless ``ignore_eos``;
    then ``max_tokens`` and ``max_model_len`` end it with ``length``.
    """
    p, tok = req.sampling_params, req.output_token_ids[-1]
    if tok in p.stop_token_ids:
        return "stop", tok
    if tok in eos_token_ids and not p.ignore_eos:
        return "stop", None
    if len(req.output_token_ids) >= req.max_tokens:
        return "length", None
    if max_model_len is not None and req.num_tokens >= max_model_len:
        return "length", None
    return None, None
