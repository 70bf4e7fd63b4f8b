"""The scheduler side, torch-free: what runs above the step boundary.

- :mod:`~pagedkv.core.scheduler`: continuous batching, chunked prefill, preemption; the only
  writer of request state. Made by :func:`~pagedkv.core.build.build_scheduler`.
- :mod:`~pagedkv.core.runner_io`: the boundary itself, ``SchedulerOutput`` (to the runner) and
  ``ModelRunnerOutput`` (back), plain picklable data.
- :mod:`~pagedkv.core.core_output`: ``EngineCoreOutput`` (to the text side) and the stop rules by id.
- :mod:`~pagedkv.core.engine_core`: ``EngineCore(scheduler, runner, clock)``.
- :mod:`~pagedkv.core.request`, :mod:`~pagedkv.core.sampling_params`: a request and its params.
- policies: :mod:`~pagedkv.core.scheduling_policy` (fcfs, priority), :mod:`~pagedkv.core.preemption`
  (swap or recompute), :mod:`~pagedkv.core.kv_eviction` (SnapKV, H2O).
- limits: :mod:`~pagedkv.core.admission` (what may run), :mod:`~pagedkv.core.limits`
  (``max_model_len``, step tokens), :mod:`~pagedkv.core.kv_layout` (KV groups of a model).
"""
