"""The torch side below the step boundary: executes a ``SchedulerOutput``, answers with a
``ModelRunnerOutput`` (:mod:`pagedkv.core.runner_io`), and never reads the KV manager.

- :mod:`~pagedkv.worker.model_runner`: ``ModelRunner`` (CPU): request state from the plain
  data, slot mappings, one forward over the KV cache, sampling, prompt log-probs, eviction scores.
- :mod:`~pagedkv.worker.sampler`, :mod:`~pagedkv.worker.prompt_logprobs`,
  :mod:`~pagedkv.worker.eviction_scores`, :mod:`~pagedkv.worker.kv_scales` (static KV scales).
- :mod:`~pagedkv.worker.spec_decode`: proposers (n-gram, draft model) behind a narrow
  ``RequestView``, and verification.
"""
