"""Speculative decoding (``speculative_config``, vLLM's name): propose a few tokens cheaply,
verify them in one forward of the target model, keep the longest run it agrees with.

- :mod:`~pagedkv.config.speculative`: the settings (method, tokens per step, n-gram window).
- :mod:`~pagedkv.worker.spec_decode.ngram`: the n-gram (prompt lookup) proposer and the adaptive
  switch that stops proposing for a request whose drafts keep failing.
- :mod:`~pagedkv.worker.spec_decode.verify`: lossless verification: greedy (accept while the draft
  is the argmax) and rejection sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et
  al. 2023, arXiv:2302.01318) for one-hot (n-gram) proposals.

The scheduler schedules a request's drafts as new tokens of it (1 + k per step) and rolls
its progress back past the rejected ones (:mod:`pagedkv.core.scheduler`); the runner
verifies and proposes (:mod:`pagedkv.worker.model_runner`).
"""
