"""The CPU KV tier behind the cache, the disk tier behind it, and swap preemption.

:mod:`~pagedkv.connectors.offload.cpu_tier` (scheduler side and the factory),
:mod:`~pagedkv.connectors.offload.cpu_tier_worker` (the copies),
:mod:`~pagedkv.connectors.offload.tier_index` (prefix-closed index), :mod:`~pagedkv.connectors.offload.swap`,
:mod:`~pagedkv.connectors.offload.disk_tier` (the disk's plan and I/O) and
:mod:`~pagedkv.connectors.offload.disk_records` (checked record files).
"""
