"""What a request may produce, decided when it arrives: shared by the engine and the simulator.

A request that could never run is rejected at once, naming the numbers: a prompt that
leaves no room under ``max_model_len``, prompt + ``max_tokens`` over it, or more KV
pages at its peak than the whole cache has (:func:`request_peak_blocks`).
"""

from __future__ import annotations

from pagedkv.core.kv_eviction import KVEvictionPolicy
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.kv.manager import KVCacheManager
from pagedkv.reprs import brief


def request_peak_blocks(kv: KVCacheManager, total: int, num_prompt: int, step_tokens: int,
                        policy: KVEvictionPolicy | None = None, params: SamplingParams | None = None) -> int:
    """The most pages (all groups) one request of ``total`` tokens, ``num_prompt`` of them
    prompt, holds at once: :meth:`KVCacheManager.peak_blocks`, bounded under score-based
    eviction (:mod:`pagedkv.core.kv_eviction`), whose compaction falls back to the
    request's own pages when the pool has no fresh ones:

    - H2O holds a prompt over its budget ``B`` whole until it is scored, then at most
      ``B`` + one page of tokens (it is scored again each time a page's worth accumulates);
    - SnapKV holds a prompt over ``B`` whole, then ``B`` + the outputs; a prompt within
      ``B`` is never scored.

    ``B`` is ``params.kv_budget_tokens``, else the policy's.
    """
    dense = kv.peak_blocks(total, step_tokens)
    if policy is None:
        return dense
    own = params.kv_budget_tokens if params is not None else None
    budget = policy.budget_tokens if own is None else own
    if policy.method == "h2o":
        return min(dense, kv.peak_blocks(max(num_prompt, budget + policy.block_size), step_tokens))
    if num_prompt <= budget:
        return dense
    after = kv.peak_blocks(budget + total - num_prompt, step_tokens)
    return min(dense, max(kv.peak_blocks(num_prompt, step_tokens), after))


def resolve_max_tokens(kv: KVCacheManager, max_model_len: int, step_tokens: int, num_prompt: int,
                       params: SamplingParams, streaming: bool = False,
                       policy: KVEvictionPolicy | None = None) -> int:
    """Output tokens this request may make (``params.max_tokens``, or up to ``max_model_len``).

    Args:
        step_tokens: the most tokens one request computes or holds slots for in a step
            (:func:`pagedkv.core.limits.step_tokens`).
        streaming: the engine runs streaming eviction (the message then says how to go longer).
        policy: the engine's SnapKV / H2O eviction, which bounds the pages a request holds.

    Raises:
        ValueError: if the request can never fit, with the limits it hits.
    """
    pool = kv.pool.num_blocks  # the cache set max_model_len: it holds that request and no longer one
    cache_bound = kv.peak_blocks(max_model_len, step_tokens) <= pool < kv.peak_blocks(max_model_len + 1, step_tokens)
    limit = f"max_model_len ({max_model_len}" + (
        f", the most one request can hold in the whole KV cache: {pool} block{'s' if pool != 1 else ''} of "
        f"{kv.block_size} tokens)" if cache_bound else ")")
    if num_prompt >= max_model_len:
        hint = " (streaming eviction runs past the model's positions: raise --max-model-len)" if streaming else ""
        raise ValueError(f"prompt of {num_prompt} tokens leaves no room for output: limit is {limit}{hint}")
    max_tokens = params.max_tokens or max_model_len - num_prompt
    total = num_prompt + max_tokens
    if total > max_model_len:
        raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({brief(max_tokens)}) = {brief(total)} "
                         f"exceeds {limit}")
    blocks = request_peak_blocks(kv, total, num_prompt, step_tokens, policy, params)
    if blocks > pool:
        smaller_steps = request_peak_blocks(kv, total, num_prompt, kv.block_size, policy, params) <= pool
        hint = (" (a request holds its window plus one step's tokens: a lower --max-num-batched-tokens, "
                f"now {step_tokens}, needs fewer)" if smaller_steps else "")
        raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {blocks} "
                         f"KV blocks of {kv.block_size} tokens, but the whole cache has {pool}{hint}")
    return max_tokens
