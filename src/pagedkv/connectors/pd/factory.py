"""The KV connector a ``kv_transfer_config`` asks for (producer or consumer side)."""

from __future__ import annotations

from pagedkv.config.kv_transfer import KVTransferConfig
from pagedkv.connectors.base import KVConnector
from pagedkv.connectors.pd.consumer import consumer_connector
from pagedkv.connectors.pd.pages import fingerprint, layout_summary
from pagedkv.connectors.pd.producer import producer_connector


def transfer_connector(cfg: KVTransferConfig, kv_manager, kv_cache, given: KVConnector | None) -> KVConnector:
    """The connector of ``cfg``'s role for an engine's KV manager (block tables, the keys its
    block hashes carry) and KV cache (the page tensors).

    Raises:
        ValueError: another connector was given, or the model's layers use more than one KV
            cache group (a transfer moves one block table).
    """
    if given is not None:
        raise ValueError("kv_transfer_config and a kv_connector cannot be combined (one KV connector per engine)")
    if len(kv_manager.kv_groups) != 1:
        raise ValueError("kv_transfer_config needs every layer in one KV cache group (this model mixes window and "
                         "full-attention layers)")
    fp, layout = fingerprint(kv_cache, kv_manager.extra_keys), layout_summary(kv_cache, kv_manager.extra_keys)
    if cfg.is_producer:
        return producer_connector(cfg, kv_cache, fp, kv_manager, layout)
    return consumer_connector(cfg, kv_manager.block_size, fp, layout)
