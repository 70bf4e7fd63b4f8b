"""Request: one prompt's state as it moves through the engine.

One counter rules scheduling: each step gives a request tokens so that
``num_computed_tokens`` catches up with ``num_tokens`` (prompt + output so far). Prefill,
chunked prefill, decode and recompute after preemption are all that one rule::

    | prompt tokens ........................ | output tokens ... |
    |<------ num_computed_tokens ------>|                       num_tokens
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedkv.core.runner_io import PromptLogprobs
from pagedkv.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: a request is one live object (list membership must not compare fields)
class Request:
    """A request's tokens, progress and timings (seconds on the engine core's clock).
    The scheduler is its only writer; no torch state (runners keep their own)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float | None = None  # set by EngineCore.add_request when None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1        # prefix-cache hit at first admission; -1 until then
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    error: str | None = None           # why an aborted request failed, if it did
    max_tokens: int = 0                # resolved against max_model_len by the engine
    priority: int = 0                  # scheduling_policy "priority": lower runs first
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for its next step
    # KV eviction with compaction (SnapKV, H2O): tokens whose KV left the cache, so token p
    # past the compacted ones sits at cache index p - num_evicted_tokens; and the runner's
    # choice (cache indices to keep, among how many), compacted when it is next scheduled
    num_evicted_tokens: int = 0
    kv_keep: tuple[list[int], int] | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: dict[int, float] = field(default_factory=dict)  # position -> log p
    prompt_top_logprobs: dict[int, dict[int, float]] = field(default_factory=dict)  # position -> top-k
    first_token_time: float | None = None
    last_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.token_times.append(now)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Record one step's prompt log-probs (positions ``chunk.first_position`` on)."""
        for i, v in enumerate(chunk.values):
            self.prompt_logprobs[chunk.first_position + i] = v
        for i, top in enumerate(chunk.top or ()):
            self.prompt_top_logprobs[chunk.first_position + i] = top
