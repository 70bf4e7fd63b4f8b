"""``--kv-transfer-config``: disaggregated prefill/decode (vLLM's flag and key names).

    {"kv_connector": "TorchDistConnector", "kv_role": "kv_producer",
     "kv_ip": "127.0.0.1", "kv_port": 14579, "kv_lease_s": 30, "kv_timeout_s": 10,
     "kv_load_failure_policy": "recompute"}

The producer (the prefill instance) listens on ``kv_ip:kv_port``; the consumer (the decode
instance) connects there. Keys:

- ``kv_lease_s``: how long the producer keeps a finished prefill's pages for the consumer
  (then they are freed, pulled or not);
- ``kv_timeout_s``: the bound on one pull (a consumer that gets no answer in time computes
  the prompt itself, or fails it under ``fail``) and on the connection's handshake;
- ``kv_send_type``: ``GET`` (the decode instance pulls a prompt's pages once its prefill has
  ended) or ``PUT_ASYNC`` (the prefill instance pushes each layer's pages as the layer writes
  them, overlapping the transfer with the rest of the prefill; the pull stays the fallback:
  :mod:`~pagedkv.connectors.pd.push`), vLLM's P2P connector's names; the producer's setting;
- ``kv_buffer_size``: bytes the decode instance holds of pushed pages not yet taken (default
  1e9, 1 GB, as vLLM); a transfer that would overflow it is pulled instead (the buffers
  are pooled and sized in powers of two: the memory behind them can reach about 3x this);
- ``kv_load_failure_policy``: ``recompute`` (the consumer computes what it could not load:
  correct, slower) or ``fail`` (the request ends with an error naming why);
- ``kv_secret``: a shared secret both instances hold (better: ``$PAGEDKV_KV_SECRET``, which
  stays out of process listings). With it, each end proves it knows the secret (HMAC-SHA256
  over a fresh nonce) before any page moves, and a peer without it is refused with one log
  line. Without it, any process that reaches ``kv_port`` can join as the consumer and pull
  the KV of other users' prompts: trusted networks only (a warning says so at start). The
  link is not encrypted either way: the pages cross the network as they are stored;
- ``kv_fault_injection``: tests only: lets a request's ``kv_transfer_params["fault"]``
  drop, delay, corrupt, stall (send part of the pages, then nothing for longer than the
  consumer waits) or duplicate its transfer, or corrupt only its pushes (``corrupt_push``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

KV_CONNECTORS = ("TorchDistConnector",)
KV_ROLES = ("kv_producer", "kv_consumer")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
FAULTS = ("drop", "delay", "corrupt", "corrupt_push", "stall", "duplicate")
SEND_TYPES = ("GET", "PUT_ASYNC")
SECRET_ENV = "PAGEDKV_KV_SECRET"


@dataclass(frozen=True)
class KVTransferConfig:
    """A parsed ``--kv-transfer-config`` (see the module docstring)."""
    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_lease_s: float = 30.0
    kv_timeout_s: float = 10.0
    kv_load_failure_policy: str = "recompute"
    kv_send_type: str = "GET"
    kv_buffer_size: int | float = 1e9
    kv_fault_injection: bool = False
    kv_secret: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, value) -> "KVTransferConfig | None":
        """From a dict, JSON text, a KVTransferConfig or None.

        Raises:
            ValueError: not JSON or not an object, an unknown key, or a bad value (named).
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_config must be a JSON object such as "
                             '{"kv_connector": "TorchDistConnector", "kv_role": "kv_producer"}')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        for key in ("kv_connector", "kv_role"):
            if key not in value:
                raise ValueError(f"kv_transfer_config needs {key!r}")
        cfg = cls(**value)
        cfg._check()
        return cfg

    def _check(self) -> None:
        for key, allowed in (("kv_connector", KV_CONNECTORS), ("kv_role", KV_ROLES),
                             ("kv_load_failure_policy", LOAD_FAILURE_POLICIES), ("kv_send_type", SEND_TYPES)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"kv_transfer_config {key} must be one of {allowed}, got {getattr(self, key)!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config kv_ip must be a host name or address, got {self.kv_ip!r}")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config kv_port must be a port number in 1..65535, got {self.kv_port!r}")
        for key in ("kv_lease_s", "kv_timeout_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
                raise ValueError(f"kv_transfer_config {key} must be seconds in (0, 86400], got {v!r}")
        v = self.kv_buffer_size
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1 << 50:
            raise ValueError(f"kv_transfer_config kv_buffer_size must be bytes in [0, 2^50], got {v!r}")
        if not isinstance(self.kv_fault_injection, bool):
            raise ValueError("kv_transfer_config kv_fault_injection must be true or false")
        if self.kv_secret is not None and (not isinstance(self.kv_secret, str) or not self.kv_secret.strip()):
            raise ValueError("kv_transfer_config kv_secret must be a non-empty string")

    @property
    def secret(self) -> bytes | None:
        """The link's shared secret: ``kv_secret``, else ``$PAGEDKV_KV_SECRET``, else None."""
        value = self.kv_secret or os.environ.get(SECRET_ENV) or None
        return value.encode() if value else None

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"
