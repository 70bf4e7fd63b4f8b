"""Disaggregated prefill/decode: the producer's and the consumer's KV connectors over a
two-rank link (:mod:`~pagedkv.connectors.pd.kv_link`), pulled or pushed pages
(:mod:`~pagedkv.connectors.pd.chunks`, :mod:`~pagedkv.connectors.pd.push`), and the factory
that picks a role (:mod:`~pagedkv.connectors.pd.factory`).
"""
