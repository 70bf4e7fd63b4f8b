"""Settings, and the only home of their defaults: torch-free dataclasses validated on construction.

- :mod:`~pagedkv.config.engine`: :class:`EngineConfig`, one flat dataclass; every field is
  also a ``pagedkv`` flag (vLLM's names), and :func:`parse_size` reads ``512MiB``-style sizes.
- :mod:`~pagedkv.config.speculative`: ``speculative_config`` (n-gram or draft model).
- :mod:`~pagedkv.config.kv_transfer`: ``kv_transfer_config`` (prefill/decode disaggregation).

This package imports nothing else of pagedkv, so every layer may read it.
"""

from pagedkv.config.engine import DEFAULT_MODEL, EngineConfig, parse_size

__all__ = ["DEFAULT_MODEL", "EngineConfig", "parse_size"]
