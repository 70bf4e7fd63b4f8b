"""The KV cache's pages themselves (torch), as the KV manager (:mod:`pagedkv.kv`) lays them out.

- :mod:`~pagedkv.kv_cache.storage`: :class:`KVCacheStorage`, per layer K and V page tensors
  ``[num_pages, block_size, num_kv_heads, head_dim]`` (page 0 the null page), writes through
  a slot mapping, page copies, a draft model's layers.
- :mod:`~pagedkv.kv_cache.quant`: int8/fp8 pages and their scales (per token-head, per head,
  per tensor, per channel), quantized on write.
"""
