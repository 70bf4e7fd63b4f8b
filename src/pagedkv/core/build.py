"""build_scheduler: the one place a :class:`~pagedkv.core.scheduler.Scheduler` is made,
from an engine config and the parts the caller owns.

The engine (:mod:`pagedkv.engine.build`), the simulator (:mod:`pagedkv.sim.engine`) and the
tests all call it, so a scheduler setting is read from :class:`~pagedkv.config.engine.EngineConfig`
in one place: budgets, the scheduling policy, speculative decoding's drafts and lookahead
slots, score-based KV eviction.
"""

from __future__ import annotations

from pagedkv.config.engine import EngineConfig
from pagedkv.connectors.base import KVConnectorScheduler
from pagedkv.core.kv_eviction import eviction_policy
from pagedkv.core.preemption import PreemptionCost
from pagedkv.core.scheduler import Scheduler
from pagedkv.kv.manager import KVCacheManager


def build_scheduler(config: EngineConfig, kv_manager: KVCacheManager, max_model_len: int | None = None,
                    eos_token_ids: frozenset[int] = frozenset(), connector: KVConnectorScheduler | None = None,
                    preemption: PreemptionCost | None = None) -> Scheduler:
    """A scheduler over ``kv_manager`` with ``config``'s settings.

    Args:
        config: the engine settings (``max_num_seqs``, ``max_num_batched_tokens``,
            ``scheduling_policy``, ``speculative_config``, ``kv_eviction`` and its sizes).
        kv_manager: the pool and block tables the scheduler allocates from.
        max_model_len: a request ends (``length``) at this many tokens (None: no limit here;
            the engine passes :func:`pagedkv.core.limits.cache_max_model_len`'s).
        eos_token_ids: token ids that end a request unless it ignores EOS.
        connector: the scheduler side of the engine's KV connector, or None.
        preemption: swap-or-recompute pricing (needs a connector that can swap), or None.
    """
    speculative = config.speculative_config
    return Scheduler(kv_manager=kv_manager, max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                     eos_token_ids=frozenset(eos_token_ids), connector=connector, policy=config.scheduling_policy,
                     preemption=preemption,
                     num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
                     num_lookahead_tokens=speculative.num_lookahead_tokens if speculative else 0,
                     eviction=eviction_policy(config))
