"""KV connectors: where KV pages move between this engine's cache and somewhere else.

:mod:`~pagedkv.connectors.base` is the seam (vLLM's KV connector v1 names): a scheduler side
that runs in the scheduler and a worker side that runs beside the model. Implementations:
:mod:`~pagedkv.connectors.offload` (the CPU and disk tiers, swap preemption) and
:mod:`~pagedkv.connectors.pd` (disaggregated prefill/decode). A new connector is a folder here.
"""
