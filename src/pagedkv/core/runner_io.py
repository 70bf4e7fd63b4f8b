"""The plain-data boundary between the scheduler and a runner: what one step computes
and what it produced.

The scheduler is the only writer of request state. It tells the runner everything the
runner needs in a :class:`SchedulerOutput` (token ids, positions, block ids per KV group)
and applies the :class:`ModelRunnerOutput` the runner answers with. Both are dataclasses
of ints, strings, lists and :class:`SamplingParams`, so they pickle: a runner may live in
another process (tensor-parallel workers, a decode worker) or be a cost model (the
simulator). Shaped after vLLM v1's ``SchedulerOutput`` / ``NewRequestData`` /
``CachedRequestData`` / ``ModelRunnerOutput``.

Per scheduled request, the step computes tokens ``[num_computed_tokens,
num_computed_tokens + num_scheduled_tokens[req_id])``::

    | computed (KV in pages) | scheduled this step | not yet |
    ^0                       ^num_computed_tokens  ^+num_scheduled_tokens

A request is sent in full the first time it is scheduled and again after a preemption
(:class:`NewRequestData`); after that only what changed (:class:`CachedRequestData`: the
tokens the runner has not seen and the pages appended to each group's table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.core.sampling_params import SamplingParams

BlockIds = tuple[list[int], ...]  # one list of page ids per KV cache group


@dataclass
class NewRequestData:
    """A request the runner has no state for (first scheduled, or resumed after preemption).

    ``token_ids`` are all its known tokens (prompt + output so far); ``block_ids`` its
    whole block table per group; ``num_computed_tokens`` counts tokens whose KV is in the
    pages already (a prefix hit), where this step's chunk starts. ``resumed``: it was
    preempted, so the runner keeps what it had of it beyond pages and tokens (its seeded
    generator); otherwise any state under this id belongs to an ended request.
    """
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: BlockIds
    num_computed_tokens: int
    resumed: bool = False


@dataclass
class CachedRequestData:
    """Requests the runner already holds, as deltas; the lists are parallel to ``req_ids``.

    ``new_token_ids[i]``: tokens appended since the runner last saw the request (the
    token it sampled last step, for a decode). ``new_block_ids[i]``: pages appended to
    each group's table, after cutting each table to ``kept_blocks[i]`` pages when that is
    not None (pages that held only rejected draft positions went back to the pool).
    ``num_computed_tokens[i]``: where this step's chunk starts. ``compacted[i]``: when not
    None, KV eviction compacted the request since the runner last saw it: the cache
    indices kept, in order; the runner copies their KV (all layers) from its old table into
    the new one (``kept_blocks`` is then all zeros and ``new_block_ids`` the whole new
    table) before the step runs, and from then on token p sits at cache index
    ``p - (num_computed_tokens[i] - len(compacted[i]))``.
    """
    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[BlockIds] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    kept_blocks: list[tuple[int, ...] | None] = field(default_factory=list)
    compacted: list[list[int] | None] = field(default_factory=list)

    def add(self, req_id: str, new_token_ids: list[int], new_block_ids: BlockIds, num_computed: int,
            kept_blocks: tuple[int, ...] | None = None, compacted: list[int] | None = None) -> None:
        self.req_ids.append(req_id)
        self.new_token_ids.append(new_token_ids)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed)
        self.kept_blocks.append(kept_blocks)
        self.compacted.append(compacted)


@dataclass
class KVTransfer:
    """Pages to move before the step runs (for offload tiers and swap): ``src`` page ids
    in ``src_tier`` to ``dst`` page ids in ``dst_tier``. Empty in this engine today."""
    src_tier: str
    dst_tier: str
    src: list[int]
    dst: list[int]


@dataclass
class SchedulerOutput:
    """One step: what to compute, in order (new requests first, then cached ones)."""
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: list[str] = field(default_factory=list)  # runner drops their pages
    finished_req_ids: list[str] = field(default_factory=list)   # ended since the last step
    kv_transfers: list[KVTransfer] = field(default_factory=list)
    kv_connector_metadata: object | None = None  # built by the connector's scheduler side
    # draft tokens to verify per request (speculative decoding); they are the last
    # len(drafts) of the request's num_scheduled_tokens, after its committed tokens
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def req_ids(self) -> list[str]:
        """Scheduled request ids in batch order."""
        return [r.req_id for r in self.scheduled_new_reqs] + list(self.scheduled_cached_reqs.req_ids)

    def chunks(self) -> list[tuple[str, int, int]]:
        """``(req_id, first position, num tokens)`` of each scheduled chunk, in batch order."""
        starts = [r.num_computed_tokens for r in self.scheduled_new_reqs]
        starts += self.scheduled_cached_reqs.num_computed_tokens
        return [(rid, start, self.num_scheduled_tokens[rid]) for rid, start in zip(self.req_ids, starts)]


@dataclass
class SampledTokens:
    """What one request produced this step: ``token_ids`` (one for a plain decode; up to
    ``k + 1`` accepted tokens under speculative decoding), their log-probs if asked
    (sampled token and the top-n, natural log), or ``error`` if this request alone failed."""
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None


@dataclass
class PromptLogprobs:
    """Prompt log-probs of one step's chunk: ``values[i]`` = log p(token at
    ``first_position + i`` | tokens before it); ``top[i]`` the top-k there, if asked."""
    first_position: int
    values: list[float]
    top: list[dict[int, float]] | None = None


@dataclass
class ModelRunnerOutput:
    """The runner's answer to one :class:`SchedulerOutput`.

    ``sampled`` has an entry for every request whose chunk reached its last token.
    ``num_draft_tokens`` is the number of speculative tokens each request proposed this
    step (its accepted count is ``len(sampled[req].token_ids) - 1``); empty without
    speculative decoding. ``finished_sending`` / ``finished_recving`` name requests whose
    asynchronous KV transfers completed (the connector's ``get_finished``).
    """
    sampled: dict[str, SampledTokens] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)  # pages whose KV load failed
    kv_connector_output: object | None = None  # the connector worker's report of the step
    execute_seconds: float = 0.0  # wall time of the step's execution (0.0: not measured)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts proposed for the next step
    # KV eviction (SnapKV): per request whose prompt ended this step, the cache indices to keep
    kv_keep: dict[str, list[int]] = field(default_factory=dict)
