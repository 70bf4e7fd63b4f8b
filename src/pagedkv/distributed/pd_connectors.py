"""The KV connector a ``kv_transfer_config`` asks for (producer or consumer side)."""

from __future__ import annotations

from pagedkv.distributed.kv_transfer_config import KVTransferConfig
from pagedkv.distributed.pages import fingerprint, layout_summary
from pagedkv.distributed.pd_consumer import consumer_connector
from pagedkv.distributed.pd_producer import producer_connector
from pagedkv.kv.connector import KVConnector


def transfer_connector(cfg: KVTransferConfig, parts, given: KVConnector | None) -> KVConnector:
    """The connector of ``cfg``'s role for an engine's ``parts`` (its pages and their keys).

    Raises:
        ValueError: another connector was given, or the model's layers use more than one KV
            cache group (a transfer moves one block table).
    """
    if given is not None:
        raise ValueError("kv_transfer_config and a kv_connector cannot be combined (one KV connector per engine)")
    if len(parts.kv.kv_groups) != 1:
        raise ValueError("kv_transfer_config needs every layer in one KV cache group (this model mixes window and "
                         "full-attention layers)")
    fp, layout = fingerprint(parts.storage, parts.kv.extra_keys), layout_summary(parts.storage, parts.kv.extra_keys)
    if cfg.is_producer:
        return producer_connector(cfg, parts.storage, fp, parts.kv, layout)
    return consumer_connector(cfg, parts.kv.block_size, fp, layout)
