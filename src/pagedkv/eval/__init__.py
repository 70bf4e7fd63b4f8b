"""Quality evaluation of KV-cache settings (``pagedkv eval``)."""
